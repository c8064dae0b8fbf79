"""Records outcomes in batches: message state, attempt rows and breakers in one transaction.

Outcomes queue up while requests run; one flush per ~20 ms (or at once when a round of the
concurrency waits) writes all that wait, at most 200, so the database cost per delivery stays
small (docs/architecture.md, "Batched completion and hot rows"), and each breaker row is
touched at most once per flush. A flush that fails because the database is away is retried
with the same outcomes: the lease token makes the retry apply nothing twice, and attempt
rows are written only for messages whose lease was still ours. A flush the database refuses
while up is split until the refused outcome is alone, so one unrecordable outcome never
holds back the others.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager as AsyncContextManager
from typing import Any

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import breaker_rows, store
from outbox.config import Settings
from outbox.leases import Claimed, Completion
from outbox.subscribers import sending_to
from sinks.attempt import DeliveryAttempt
from sinks.fanout import SinkFanout
from supervisor.cycle import breaker_moves, challenge
from supervisor.observe import events, health_stats, tracing
from supervisor.cycle.attempt import Outcome
from supervisor.cycle.breaker import CircuitBreakerPolicy, apply_outcomes, closed_row, window_counts
from supervisor.wire.classify import RetryPolicy
from supervisor.observe.metrics import Metrics, status_class
from supervisor.cycle.outage import OutageGuard, diagnose
from supervisor.cycle.outcome_plan import plan
from supervisor.cycle.pgdirect import DirectConnection

FLUSH_INTERVAL = 0.02
FLUSH_MAX = 200  # outcomes per flush at most; a flush starts early at one round of the concurrency
RECORDING = "record outcomes"  # the outage guard's name for this activity
REFUSED_TRIES = 2  # a lone outcome the database refuses is tried this often, then left to its lease
Endpoint = tuple[str, str]  # (tenant, origin): a breaker's key
# Told after each batch: the retryable failures no longer pending here (their request slots
# free), and the endpoints whose breakers that batch opened.
Recorded = Callable[[Sequence[Claimed], Sequence[Endpoint]], None]


def _judges_breaker(o: Outcome) -> bool:
    """Whether ``o`` makes its endpoint's breaker row worth locking: a retryable failure, or
    any answer from an endpoint that has a row. An endpoint with no row that only succeeded
    needs none, which keeps the common flush to its message and attempt rows."""
    m = o.message
    return o.sent and bool(m.origin) and (o.action == "retry" or m.breaker_state is not None)


def _endpoint(o: Outcome) -> Endpoint:
    """The breaker an outcome with an origin is judged under."""
    return o.message.tenant_id, o.message.origin or ""


def _returns_probe(o: Outcome) -> bool:
    """Whether ``o``'s message held its endpoint's half-open probe and went unsent: the probe is given back."""
    return o.message.holds_probe and not o.sent


def _may_continue(o: Outcome) -> bool:
    """Whether ``o`` leaves a subscriber's fire pending: then its subscriber's state decides."""
    return o.message.subscriber_ref is not None and o.action not in ("delivered", "dead", "expire")


def _locks_rows(o: Outcome) -> bool:
    """Whether recording ``o`` may write a breaker (:meth:`Completer._update_breakers`, or a
    probe given back), settle a proof or read its subscriber's state: such a batch is recorded
    through SQLAlchemy."""
    return (_judges_breaker(o) or challenge.is_challenge(o.message.notification_type) or _may_continue(o)
            or _returns_probe(o))


async def _revoked(conn, batch: Sequence[Outcome]) -> set[int]:
    """The batch's messages whose subscriber was removed or paused while they were in flight:
    they end dead ``cancelled`` instead of pending (docs/reporting.md, "Revocation"). One
    statement, only when the batch has such a fire. The rows are read ``FOR SHARE``: a
    revocation committing meanwhile waits for this flush, then cancels what it left pending."""
    refs = {ref for o in batch if _may_continue(o) and (ref := o.message.subscriber_ref) is not None}
    if not refs:
        return set()
    live = set((await conn.execute(sending_to(list(refs)).with_for_update(read=True))).scalars())
    return {o.message.id for o in batch if _may_continue(o) and o.message.subscriber_ref not in live}


class Completer:
    def __init__(self, engine: AsyncEngine, *, settings: Settings, daemon_id: str, metrics: Metrics,
                 fanout: SinkFanout, outage: OutageGuard, on_recorded: Recorded = lambda failures, tripped: None
                 ) -> None:
        self._engine = engine
        self._direct = DirectConnection.of(engine, settings)
        # Recording frees per-origin capacity (a retryable failure holds its slot until
        # then) and may trip breakers: tell the claimer, or it would sleep out its poll
        # interval with work due, or send what waits for a tripped endpoint.
        self._on_recorded = on_recorded
        self._settings = settings
        self._retry = RetryPolicy(settings.retry_base_seconds, settings.retry_max_seconds)
        self._breaker_policy = CircuitBreakerPolicy(
            failure_threshold=settings.breaker_failure_threshold,
            success_threshold=settings.breaker_success_threshold,
            open_timeout_seconds=settings.breaker_open_seconds,
            max_open_timeout_seconds=settings.breaker_max_open_seconds,
            failure_ratio=settings.breaker_failure_ratio, window_seconds=settings.breaker_window_seconds)
        self._daemon_id = daemon_id
        self._metrics = metrics
        self._fanout = fanout
        self._outage = outage
        self._queue: asyncio.Queue[Outcome] = asyncio.Queue()
        # Outcomes run() has taken off the queue but not yet recorded, and the lock run()
        # holds while it records them: drain() must neither miss nor race that batch.
        self._taken: list[Outcome] = []
        self._recording: Sequence[Outcome] = ()  # the outcomes of the flush under way
        self._flushing = asyncio.Lock()
        # Unrecorded outcomes hold leases the claimer counts against its budget: a round of
        # them is worth a flush at once rather than at the end of the interval.
        self._flush_early = min(FLUSH_MAX, settings.concurrency)
        self._log = structlog.get_logger("outboxd.completer")

    def submit(self, outcome: Outcome) -> None:
        self._queue.put_nowait(outcome)

    @property
    def backlog(self) -> int:
        """Outcomes not yet recorded (each still holds its message's lease)."""
        return self._queue.qsize() + len(self._taken) + len(self._recording)

    async def run(self) -> None:
        """Flush forever; cancelled by the daemon after :meth:`drain`."""
        while True:
            self._taken.append(await self._queue.get())
            async with self._flushing:
                deadline = time.monotonic() + FLUSH_INTERVAL
                while self._taken and len(self._taken) < self._flush_early:
                    timeout = deadline - time.monotonic()
                    if timeout <= 0:
                        break
                    try:
                        self._taken.append(await asyncio.wait_for(self._queue.get(), timeout))
                    except asyncio.TimeoutError:
                        break
                # What queued up meanwhile goes along (a round starts the flush early, it is not
                # a limit): with many origins the outcomes come faster than flushes of one round
                # record them, and the claimer, which counts unrecorded outcomes against its
                # lease budget, then waited out every flush (docs/performance.md, "Design
                # choices, each measured against the alternative").
                self._take_queued(self._taken, FLUSH_MAX)
                batch, self._taken = self._taken, []
                if batch:  # empty when drain() took it while we waited for the lock
                    self._recording = batch  # kept if the flush never ends: give_up() reports it
                    await self._flush_until_done(batch)
                    self._recording = ()

    async def drain(self) -> None:
        """Flush everything not yet recorded (shutdown), including a batch run() is recording.

        Waits for a flush in progress to finish, so the daemon may cancel :meth:`run`
        afterwards without losing the outcomes it had taken off the queue.
        """
        async with self._flushing:
            batch, self._taken = self._taken, []
            self._take_queued(batch)
            if batch:
                self._recording = batch  # what give_up() reports if the flush never ends
                await self._flush_until_done(batch)
                self._recording = ()

    def give_up(self) -> int:
        """At exit, with the database away: one ``outcome.unrecorded`` line for each outcome
        never recorded (a request a receiver may have answered leaves no attempt row, so the
        log is its only record), and how many. Each message keeps its lease and is sent again
        once the lease runs out, as after a crash."""
        left = [*self._recording, *self._taken]
        self._take_queued(left)
        self._recording, self._taken = (), []
        for o in left:
            m = o.message
            self._log.error("outcome.unrecorded", message_id=m.id, tenant_id=m.tenant_id,
                            idempotency_key=m.idempotency_key, attempt=m.attempt, outcome=o.outcome,
                            http_status=o.http_status, sent=o.sent, retry="after the lease expires")
        return len(left)

    def _take_queued(self, batch: list[Outcome], limit: int | None = None) -> None:
        """Move what waits on the queue into ``batch``, until it holds ``limit`` (all: ``None``)."""
        while (limit is None or len(batch) < limit) and not self._queue.empty():
            batch.append(self._queue.get_nowait())

    async def _flush_until_done(self, batch: Sequence[Outcome], *, tries: int = REFUSED_TRIES) -> None:
        """Record ``batch``: ride out an outage, and isolate an outcome the database refuses.

        A failed flush while the database answers means it refused something in this batch
        (a constraint, a trigger, a bug of ours), not that it is away. Retrying the whole
        batch would hold every other outcome behind that one until all their leases expire,
        and every message in it would be sent again. So the batch is halved until the
        refused outcome is alone; after a few tries it is given up: its message stays leased,
        the rescuer writes its ``abandoned`` attempt when the lease runs out, and it is sent
        again then. Nothing is lost, and nothing is recorded twice (the lease token fences).
        """
        while True:
            try:
                await self.flush(batch)
                self._outage.ok(RECORDING)
                return
            except Exception as exc:
                if not diagnose(exc).curable or not await self._reachable():
                    await self._outage.failed(RECORDING, exc)
                    continue
                self._outage.ok(RECORDING)
                refused = exc
                break
        if len(batch) > 1:
            middle = len(batch) // 2
            await self._flush_until_done(batch[:middle])
            await self._flush_until_done(batch[middle:])
            return
        if tries > 1:  # once more at once: a deadlock or serialization failure passes
            await self._flush_until_done(batch, tries=tries - 1)
            return
        m = batch[0].message
        # Left to its lease: the rescuer hands it back when the lease runs out. Its request is
        # over, so it must not hold a slot of its origin either (a tenant whose outcomes cannot
        # be recorded would otherwise crowd out the origin's other tenants): a failure's slot
        # frees here, any other outcome's freed when its request ended.
        self._on_recorded([m] if batch[0].action == "retry" else [], [])
        self._log.error("outcome.unrecorded", message_id=m.id, idempotency_key=m.idempotency_key, attempt=m.attempt,
                        outcome=batch[0].outcome, error=type(refused).__name__,
                        detail=(str(getattr(refused, "orig", None) or refused).splitlines() or [""])[0][:200],
                        retry="after the lease expires")

    async def _reachable(self) -> bool:
        """Whether the database answers at all (an outage, as opposed to a refused write)."""
        try:
            async with asyncio.timeout(self._settings.database_statement_timeout_seconds):
                async with self._engine.connect() as conn:
                    await store.db_now(conn)
            return True
        except Exception:
            return False

    async def aclose(self) -> None:
        if self._direct is not None:
            await self._direct.aclose()

    def _transaction(self, batch: Sequence[Outcome]) -> AsyncContextManager[Any]:
        """The driver's own connection (PostgreSQL) when the batch has no breaker or proof to
        write, which is the common case; SQLAlchemy otherwise (supervisor/cycle/pgdirect.py)."""
        if self._direct is not None and not any(_locks_rows(o) for o in batch):
            return self._direct.transaction()
        return self._engine.begin()

    async def flush(self, batch: Sequence[Outcome]) -> None:
        with tracing.span("outboxd.flush", {"outboxd.outcomes": len(batch)}):
            await self._record(batch)

    async def _record(self, batch: Sequence[Outcome]) -> None:
        async with self._transaction(batch) as conn:
            now = await store.db_now(conn)
            revoked = await _revoked(conn, batch)
            plans = [plan(outcome, now, retry=self._retry, daemon_id=self._daemon_id,
                          revoked=outcome.message.id in revoked) for outcome in batch]
            applied = await store.complete(conn, [completion for completion, _ in plans])
            # The excerpt goes to the row only: the record itself reaches the sinks (logs).
            await store.insert_attempts(conn, [record.as_row() | {"response_excerpt": o.response_excerpt}
                                               for o, (completion, record) in zip(batch, plans)
                                               if record is not None and completion.message_id in applied])
            moves = await self._update_breakers(conn, batch, applied, now)
            await breaker_rows.return_probes(conn, [(o.message.tenant_id, o.message.origin or "") for o in batch
                                                    if _returns_probe(o) and o.message.id in applied])
            settled = await self._settle_proofs(conn, batch, plans, applied)
            await self._observe(conn, batch, plans, applied, now)
        settled.count(self._metrics)
        self._on_recorded([o.message for o in batch if o.action == "retry"],
                          [(m["tenant_id"], m["origin"]) for m in moves if m["to_state"] == "open"])
        self._after_commit(batch, plans, applied, moves, now)

    async def _settle_proofs(self, conn, batch: Sequence[Outcome],
                             plans: Sequence[tuple[Completion, DeliveryAttempt | None]],
                             applied: set[int]) -> challenge.Settled:
        """Finished URL challenges make their subscribers active or failed (same transaction),
        a challenge that expired before its request could start included."""
        ended = [c for o, (c, _) in zip(batch, plans) if c.message_id in applied
                 and c.state in ("delivered", "dead") and challenge.is_challenge(o.message.notification_type)]
        if not ended:
            return challenge.Settled()
        return await challenge.settle(conn, [c.message_id for c in ended if c.state == "delivered"],
                                      [c.message_id for c in ended if c.state == "dead"])

    async def _observe(self, conn, batch: Sequence[Outcome], plans: Sequence[tuple[Completion, DeliveryAttempt | None]],
                       applied: set[int], now: float) -> None:
        """Endpoint health and operator events of the batch (same transaction): one rollup
        upsert per flush, and events only for messages that ended dead (docs/observability.md)."""
        recorded = [(o, c, r) for o, (c, r) in zip(batch, plans) if o.message.id in applied]
        await health_stats.record(conn, health_stats.tally(
            (health_stats.Recorded.of(o.message.tenant_id, o.message.origin, o.outcome if r is not None else None,
                                      o.response_time_ms, c.state == "dead")
             for o, c, r in recorded if o.message.origin),
            now=now, daemon_id=self._daemon_id))
        await events.messages_ended(conn, [(o.message.tenant_id, o.message.origin, c.dead_reason)
                                           for o, c, _ in recorded if c.state == "dead"],
                                    now=now, window=self._settings.operator_events_window_seconds)

    async def _update_breakers(self, conn, batch: Sequence[Outcome], applied: set[int], now: float
                               ) -> list[dict[str, Any]]:
        """Fold this batch's request outcomes into the breakers: O(1) writes per endpoint.

        A row is written only when it changes; a trip writes the row and one transition
        row, nothing per message (the claim passes over an open endpoint).
        """
        recorded = [o for o in batch if o.sent and o.message.id in applied and o.message.origin]
        judged = {_endpoint(o) for o in recorded if _judges_breaker(o)}
        if not judged:
            return []
        per_key: dict[Endpoint, list[bool]] = defaultdict(list)
        for o in recorded:
            key = _endpoint(o)
            if key in judged:
                # Any definitive answer shows the endpoint alive; only retryable failures count against it.
                per_key[key].append(o.action != "retry")
        had_row = {_endpoint(o) for o in batch if o.message.breaker_state is not None}
        await breaker_rows.ensure_breakers(conn, [k for k in per_key if k not in had_row])
        rows = await breaker_rows.lock_breakers(conn, per_key)
        changed: list[dict[str, Any]] = []
        moves: list[dict[str, Any]] = []
        for key, results in per_key.items():
            row = rows.get(key) or closed_row(*key)
            new, moved = apply_outcomes(row, results, now=now, policy=self._breaker_policy)
            if new != row:
                changed.append(new)
            attempts, failures = window_counts(row, now, self._breaker_policy.window_seconds)
            moves.extend(breaker_moves.move(*key, before, after, open_until=new["open_until"],
                                            daemon_id=self._daemon_id, now=now,
                                            window_attempts=attempts + len(results),
                                            window_failures=failures + results.count(False))
                         for before, after in moved)
        await breaker_rows.save_breakers(conn, changed)
        await breaker_rows.insert_transitions(conn, moves)
        await events.breakers_moved(conn, moves)
        return moves

    def _after_commit(self, batch: Sequence[Outcome], plans: Sequence[tuple[Completion, DeliveryAttempt | None]],
                      applied: set[int], moves: Sequence[Mapping[str, Any]], now: float) -> None:
        metrics = self._metrics
        breaker_moves.announce(moves, metrics, self._log)
        for o, (completion, record) in zip(batch, plans):
            m = o.message
            labels = metrics.tenant_labels(m.tenant_id)
            if record is not None:  # a request was made (or refused before sending): count it
                metrics.attempts.labels(outcome=o.outcome, status_class=status_class(o.http_status), **labels).inc()
                if o.response_time_ms is not None:
                    metrics.attempt_duration.observe(o.response_time_ms / 1000)
            if m.id not in applied:
                if record is not None:
                    self._log.warning("lease.lost", message_id=m.id, idempotency_key=m.idempotency_key,
                                      attempt=m.attempt, outcome=o.outcome)
                continue
            if record is not None:
                self._fanout.publish(record)
            if completion.state == "delivered":
                metrics.deliveries.labels(outcome="delivered", **labels).inc()
                metrics.commit_to_delivery.observe(max(now - m.created_at, 0.0))
            elif completion.state == "dead":
                metrics.count_dead(completion.dead_reason, m.tenant_id)
                # a delivery is logged once, by the attempt line (sinks); a dead message once more
                self._log.warning("message.dead", message_id=m.id, tenant_id=m.tenant_id,
                                  idempotency_key=m.idempotency_key, attempt=m.attempt, outcome=o.outcome,
                                  reason=completion.dead_reason)
