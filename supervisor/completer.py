"""Records outcomes in batches: message state, attempt rows and breakers in one transaction.

Outcomes queue up while requests run; one flush per ~20 ms (or per 200 outcomes) writes
them all, so the database cost per delivery stays small (docs/architecture.md,
"Batched completion and hot rows"), and each breaker row is touched at most once per flush. A flush that
fails because the database is away is retried with the same outcomes: the lease token makes
the retry apply nothing twice, and attempt rows are written only for messages whose lease
was still ours. A flush the database refuses while up is split until the refused outcome is
alone, so one unrecordable outcome never holds back the others.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import store
from outbox.config import Settings
from outbox.store import Completion
from outbox.urls import without_query
from sinks.attempt import DeliveryAttempt
from sinks.fanout import SinkFanout
from supervisor.attempt import Outcome
from supervisor.breaker import CircuitBreakerPolicy, apply_outcomes, closed_row
from supervisor.classify import RetryPolicy
from supervisor.metrics import Metrics, status_class
from supervisor.outage import OutageGuard

FLUSH_INTERVAL = 0.02
FLUSH_MAX = 200
REFUSED_TRIES = 2  # a lone outcome the database refuses is tried this often, then left to its lease


@dataclass(frozen=True)
class Policies:
    retry: RetryPolicy
    breaker: CircuitBreakerPolicy

    @classmethod
    def from_settings(cls, settings: Settings) -> "Policies":
        return cls(
            RetryPolicy(settings.retry_base_seconds, settings.retry_max_seconds),
            CircuitBreakerPolicy(settings.breaker_failure_threshold, settings.breaker_success_threshold,
                                 settings.breaker_open_seconds, settings.breaker_max_open_seconds),
        )


class Completer:
    def __init__(self, engine: AsyncEngine, *, settings: Settings, daemon_id: str, metrics: Metrics,
                 fanout: SinkFanout, outage: OutageGuard) -> None:
        self._engine = engine
        self._settings = settings
        self._policies = Policies.from_settings(settings)
        self._daemon_id = daemon_id
        self._metrics = metrics
        self._fanout = fanout
        self._outage = outage
        self._queue: asyncio.Queue[Outcome] = asyncio.Queue()
        # Outcomes run() has taken off the queue but not yet recorded, and the lock run()
        # holds while it records them: drain() must neither miss nor race that batch.
        self._taken: list[Outcome] = []
        self._recording = 0  # outcomes in the flush under way
        self._flushing = asyncio.Lock()
        self._log = structlog.get_logger("outboxd.completer")

    def submit(self, outcome: Outcome) -> None:
        self._queue.put_nowait(outcome)

    @property
    def backlog(self) -> int:
        """Outcomes not yet recorded (each still holds its message's lease)."""
        return self._queue.qsize() + len(self._taken) + self._recording

    async def run(self) -> None:
        """Flush forever; cancelled by the daemon after :meth:`drain`."""
        while True:
            self._taken.append(await self._queue.get())
            async with self._flushing:
                deadline = time.monotonic() + FLUSH_INTERVAL
                while self._taken and len(self._taken) < FLUSH_MAX:
                    timeout = deadline - time.monotonic()
                    if timeout <= 0:
                        break
                    try:
                        self._taken.append(await asyncio.wait_for(self._queue.get(), timeout))
                    except asyncio.TimeoutError:
                        break
                batch, self._taken = self._taken, []
                if batch:  # empty when drain() took it while we waited for the lock
                    self._recording = len(batch)
                    try:
                        await self._flush_until_done(batch)
                    finally:
                        self._recording = 0

    async def drain(self) -> None:
        """Flush everything not yet recorded (shutdown), including a batch run() is recording.

        Waits for a flush in progress to finish, so the daemon may cancel :meth:`run`
        afterwards without losing the outcomes it had taken off the queue.
        """
        async with self._flushing:
            batch, self._taken = self._taken, []
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            if batch:
                await self._flush_until_done(batch)

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
                self._outage.ok()
                return
            except Exception as exc:
                if not await self._reachable():
                    await self._outage.failed("record outcomes", exc)
                    continue
                self._outage.ok()
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
        self._log.error("outcome.unrecorded", message_id=m.id, idempotency_key=m.idempotency_key, attempt=m.attempt,
                        outcome=batch[0].outcome, error=type(refused).__name__,
                        detail=(str(getattr(refused, "orig", None) or refused).splitlines() or [""])[0][:200],
                        retry="after the lease expires")

    async def _reachable(self) -> bool:
        """Whether the database answers at all (an outage, as opposed to a refused write)."""
        try:
            async with self._engine.connect() as conn:
                await store.db_now(conn)
            return True
        except Exception:
            return False

    async def flush(self, batch: Sequence[Outcome]) -> None:
        async with self._engine.begin() as conn:
            now = await store.db_now(conn)
            plans = [self._plan(outcome, now) for outcome in batch]
            applied = await store.complete(conn, [completion for completion, _ in plans])
            await store.insert_attempts(conn, [record.as_row() for completion, record in plans
                                               if record is not None and completion.message_id in applied])
            transitions = await self._update_breakers(conn, batch, applied, now)
        self._after_commit(batch, plans, applied, transitions, now)

    def _plan(self, o: Outcome, now: float) -> tuple[Completion, DeliveryAttempt | None]:
        """The message's new state, and its attempt record (``None``: no attempt was made)."""
        m = o.message
        state, reason, next_at, delta = "pending", None, None, 0
        if o.action == "delivered":
            state = "delivered"
        elif o.action == "dead":
            state, reason = "dead", o.reason
        elif o.action == "skip":
            next_at, delta = now + (o.defer_seconds or 1.0), -1
        elif o.action == "release":
            next_at, delta = now, -1
        else:  # retry, or abandoned at shutdown
            delay = self._policies.retry.delay_for_attempt(m.attempt)
            next_at = now + max(delay, o.retry_after or 0.0)
            if o.outcome == "abandoned":
                next_at = now
            elif next_at >= m.retry_until:  # never send after first attempt + horizon (protocol.md, "Retry horizon")
                state, reason, next_at = "dead", "expired", None
        completion = Completion(m.id, m.lease_token, state, reason, next_at, delta, o.http_status, o.error)
        if o.action == "release":
            return completion, None
        record = DeliveryAttempt(
            message_id=m.id, tenant_id=m.tenant_id, url=without_query(m.url), attempt_number=m.attempt,
            outcome=o.outcome, http_status_code=o.http_status, error_message=o.error,
            response_time_ms=o.response_time_ms, will_retry=state == "pending",
            next_retry_at=next_at if state == "pending" else None, payload_size_bytes=len(m.body),
            sequence_number=m.sequence_number, idempotency_key=m.idempotency_key,
            notification_type=m.notification_type, trigger=m.trigger, daemon_id=self._daemon_id, occurred_at=now,
        )
        return completion, record

    async def _update_breakers(self, conn, batch: Sequence[Outcome], applied: set[int], now: float
                               ) -> list[tuple[str, str]]:
        per_key: dict[tuple[str, str], list[bool]] = defaultdict(list)
        for o in batch:
            if o.sent and o.message.id in applied and o.message.origin:
                # Any definitive answer shows the endpoint alive; only retryable failures count against it.
                per_key[(o.message.tenant_id, o.message.origin)].append(o.action != "retry")
        # The hot path: an endpoint that had no breaker row at claim time and only succeeded
        # needs no row and no lock (one fewer statement per flush when all is well).
        had_row = {(o.message.tenant_id, o.message.origin) for o in batch if o.message.breaker_state is not None}
        per_key = {k: v for k, v in per_key.items() if k in had_row or not all(v)}
        if not per_key:
            return []
        rows = await store.lock_breakers(conn, per_key)
        changed, transitions = [], []
        for key, results in per_key.items():
            row = rows.get(key)
            if row is None and all(results):
                continue
            new, moved = apply_outcomes(row or closed_row(*key), results, now=now, policy=self._policies.breaker)
            if new != row:
                changed.append(new)
            transitions.extend(moved)
            for before, after in moved:
                self._log.warning("breaker.transition", tenant_id=key[0], origin=key[1], from_state=before,
                                  to_state=after, open_until=new["open_until"])
        await store.save_breakers(conn, changed)
        for row in changed:
            if row["state"] == "open" and (row["tenant_id"], row["origin"]) in per_key:
                # Move the endpoint's backlog past the open period, so claims stop scanning
                # over messages they may not send (no attempt is made or counted).
                moved = await store.defer_endpoint(conn, row["tenant_id"], row["origin"], row["open_until"],
                                                   self._daemon_id)
                if moved:
                    self._log.info("breaker.deferred", tenant_id=row["tenant_id"], origin=row["origin"],
                                   messages=moved, until=row["open_until"])
        return transitions

    def _after_commit(self, batch: Sequence[Outcome], plans: Sequence[tuple[Completion, DeliveryAttempt | None]],
                      applied: set[int], transitions: list[tuple[str, str]], now: float) -> None:
        metrics = self._metrics
        for before, after in transitions:
            metrics.breaker_transitions.labels(from_state=before, to_state=after).inc()
        for o, (completion, record) in zip(batch, plans):
            m = o.message
            if record is None:  # released unattempted: nothing happened worth a metric or a log
                continue
            labels = metrics.tenant_labels(m.tenant_id)
            metrics.attempts.labels(outcome=o.outcome, status_class=status_class(o.http_status), **labels).inc()
            if o.response_time_ms is not None:
                metrics.attempt_duration.observe(o.response_time_ms / 1000)
            if m.id not in applied:
                self._log.warning("lease.lost", message_id=m.id, idempotency_key=m.idempotency_key,
                                  attempt=m.attempt, outcome=o.outcome)
                continue
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
