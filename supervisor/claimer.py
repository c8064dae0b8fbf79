"""Leases due messages and starts their attempts, within the concurrency limits.

The per-origin cap (``OUTBOX_ENDPOINT_CONCURRENCY``) and the breakers are applied inside
the claim statement (:func:`outbox.store.claim`): it counts this daemon's in-flight rows
per origin, so a slow or hanging endpoint holds at most its own share of slots, never
makes other tenants' messages wait behind it, and nothing claimed has to be handed back.
This module holds the global cap (``OUTBOX_CONCURRENCY``, which also counts outcomes still
waiting for the completer, since they hold leases too) and takes the half-open probe.
A freed slot runs the claim again only when the last claim may have left due work behind;
otherwise new work (a NOTIFY), the poll or the earliest retry's time wakes it.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import store
from outbox.config import Settings
from outbox.store import Claimed
from supervisor.attempt import Outcome
from supervisor.breaker import CircuitState
from supervisor.metrics import Metrics
from supervisor.outage import OutageGuard

Attempt = Callable[[Claimed], Awaitable[Outcome]]
BACKLOG_RECHECK_SECONDS = 0.05
# After a partial claim, wake-ups (requests ending, flushes, NOTIFYs) within this long are
# served by one claim, not one each.
CLAIM_COOLDOWN_SECONDS = 0.005


class Claimer:
    def __init__(self, engine: AsyncEngine, *, settings: Settings, daemon_id: str, metrics: Metrics,
                 attempt: Attempt, submit: Callable[[Outcome], None], outage: OutageGuard,
                 backlog: Callable[[], int] = lambda: 0,
                 unrecorded: Callable[[], list[int]] = lambda: []) -> None:
        self._engine = engine
        # PostgreSQL: single statements in autocommit, no BEGIN/COMMIT round trips. SQLite
        # keeps its BEGIN IMMEDIATE transactions (the driver's autocommit mode and ours clash).
        self._autocommit = (engine.execution_options(isolation_level="AUTOCOMMIT")
                            if engine.dialect.name == "postgresql" else engine)
        # Outcomes waiting to be recorded still hold their leases: past one round of the
        # concurrency they count against it, so a completer that falls behind slows claiming
        # instead of letting leases pile up (a crash would resend every one of them).
        self._backlog = backlog
        self._unrecorded = unrecorded  # leased messages whose request is over (no slot held)
        self._settings = settings
        self._daemon_id = daemon_id
        self._metrics = metrics
        self._attempt = attempt
        self._submit = submit
        self._outage = outage
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._per_origin: Counter[str] = Counter()  # requests in flight per origin
        # Whether the last claim may have left due work behind (a full batch, or an origin at
        # its cap): only then can a freed slot make anything claimable. Otherwise what is due
        # was all taken, and only new work (a NOTIFY), the poll or a retry's time brings more:
        # a request ending is no reason to run the claim again.
        self._capped = True
        self._wake = asyncio.Event()
        self._stopping = False
        self._log = structlog.get_logger("outboxd.claimer")

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def wake(self) -> None:
        """New work may be due now (a NOTIFY)."""
        self._wake.set()

    def freed(self) -> None:
        """Capacity freed (a request ended, outcomes recorded): claim again if work was left behind."""
        if self._capped:
            self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        while not self._stopping:
            # Outcomes queued for the completer hold leases too: once more than a full round
            # of them waits, the completer is behind and claiming pauses until it catches up.
            free = self._settings.concurrency - self.in_flight - max(self._backlog() - self._settings.concurrency, 0)
            if free <= 0:  # full, or the completer is behind: look again when a slot frees
                await self._sleep(BACKLOG_RECHECK_SECONDS)
                continue
            limit = min(free, self._settings.claim_batch)
            timeout = self._settings.poll_interval_seconds
            try:
                batch = await self._claim(limit)
                if len(batch) == limit:
                    self._outage.ok()
                    continue  # more may be due: claim again at once
                if not batch and not self._tasks:  # idle: sleep until the earliest retry, at most a poll
                    next_due, now = await self._next_due()
                    if next_due is not None and next_due > now:
                        timeout = min(timeout, next_due - now)
                # A partial batch took everything that may go now; a request ending, a flush,
                # a NOTIFY or the poll brings the rest.
                self._outage.ok()
            except Exception as exc:
                await self._outage.failed("claim messages", exc)
                continue
            await self._sleep(timeout)
            await asyncio.sleep(CLAIM_COOLDOWN_SECONDS)

    async def _sleep(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), max(timeout, 0.001))
        except asyncio.TimeoutError:
            pass
        self._wake.clear()

    async def _claim(self, limit: int) -> list[Claimed]:
        async with self._autocommit.begin() as conn:
            batch = await store.claim(conn, limit=limit, lease_seconds=self._settings.lease_seconds,
                                      horizon_seconds=self._settings.retry_horizon_seconds,
                                      daemon_id=self._daemon_id,
                                      endpoint_concurrency=self._settings.endpoint_concurrency,
                                      done_ids=self._unrecorded())
        self._metrics.claim_batch.observe(len(batch))
        self._capped = len(batch) >= limit
        for message in batch:
            if not await self._may_send(message):
                # Another daemon took this endpoint's half-open probe between our claim and
                # now: hand the message back untouched (no attempt made, none counted).
                self._submit(Outcome(message, "release", "released"))
                continue
            self._per_origin[message.origin or ""] += 1
            self._tasks[message.id] = asyncio.create_task(self._run_attempt(message))
        # Outcomes not yet recorded may still hold slots of any origin (the claim counts them):
        # counting all of them against every origin errs towards claiming again, never stalling.
        unrecorded = self._backlog()
        cap = self._settings.endpoint_concurrency
        self._capped = self._capped or any(n + unrecorded >= cap for n in self._per_origin.values())
        self._metrics.in_flight.set(self.in_flight)
        return batch

    async def _may_send(self, message: Claimed) -> bool:
        """Whether the message may go now: always, unless it is its endpoint's probe.

        The claim returns an endpoint whose breaker is open or half-open only once the
        open period is over, and then one message: it goes if this daemon wins the probe.
        """
        if message.breaker_state in (None, CircuitState.CLOSED.value):
            return True
        async with self._autocommit.begin() as conn:
            return await store.acquire_probe(conn, message.tenant_id, message.origin or "",
                                             self._settings.lease_seconds)

    async def _run_attempt(self, message: Claimed) -> None:
        try:
            outcome = await self._attempt(message)
        except asyncio.CancelledError:
            outcome = Outcome(message, "retry", "abandoned", error="attempt interrupted at shutdown")
            raise
        except Exception as exc:  # a bug must not lose the message: record and retry it
            self._log.exception("attempt.crashed", message_id=message.id)
            outcome = Outcome(message, "retry", "failed", error=f"internal error: {type(exc).__name__}")
        finally:
            self._tasks.pop(message.id, None)
            origin = message.origin or ""
            self._per_origin[origin] -= 1
            if self._per_origin[origin] <= 0:
                del self._per_origin[origin]
            self._metrics.in_flight.set(self.in_flight)
            self._submit(outcome)  # noqa: B012 - recorded even when cancelled
            self.freed()  # a slot (global and of its origin) is free: look again if that can help

    async def _next_due(self) -> tuple[float | None, float]:
        async with self._autocommit.begin() as conn:
            return await store.next_due_at(conn)

    async def finish(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for attempts in flight, then interrupt the rest."""
        tasks = list(self._tasks.values())
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
