"""Leases due messages and starts their attempts, within the concurrency limits.

The per-origin budget and the breakers are applied inside the claim statement
(:func:`outbox.store.claim`): it counts this daemon's leases per origin, so a slow or
hanging endpoint holds at most its own share, never makes other tenants' messages wait
behind it. The budget is two rounds of ``OUTBOX_ENDPOINT_CONCURRENCY``: one of requests,
one waiting its turn in :class:`supervisor.cycle.dispatch.Dispatcher`, which starts the next
message the moment a request ends. This module holds the global cap (``OUTBOX_CONCURRENCY``
requests, twice that with the messages waiting, and three times that in leases when the
completer falls behind) and takes the half-open probe.

A claim runs on new work (a NOTIFY), on the poll, at the earliest retry's time, at once
after a full batch, soon after one that another daemon's claim contended (at once, then
backing off), and when a request ends while the last claim left due work behind
(a full batch, or an origin at its budget) and that origin's queue has run low, if it still
has when the claimer gets to it: never after a fixed pause, so a message committed alone is
claimed as soon as its NOTIFY arrives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager as AsyncContextManager, nullcontext
from typing import Any

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import breaker_rows, store
from outbox.config import Settings
from outbox.leases import Claimed, ClaimedBatch
from supervisor.observe import events, tracing
from supervisor.cycle.attempt import Outcome
from supervisor.cycle import breaker_moves
from supervisor.cycle.breaker import CircuitState
from supervisor.cycle.dispatch import Dispatcher
from supervisor.observe.metrics import Metrics
from supervisor.cycle.outage import OutageGuard, unless_stopped
from supervisor.cycle.pgdirect import DirectConnection

Attempt = Callable[[Claimed], Awaitable[Outcome]]
BACKLOG_RECHECK_SECONDS = 0.05
CONTENDED_BACKOFF_SECONDS = 0.01  # the first pause after contended claims in a row; it doubles up to a poll
CLAIMING = "claim messages"  # the outage guard's name for this activity
LEASE_ROUNDS = 2  # leases per origin (and in all) per round of requests: one running, one waiting


class Claimer:
    def __init__(self, engine: AsyncEngine, *, settings: Settings, daemon_id: str, metrics: Metrics,
                 attempt: Attempt, submit: Callable[[Outcome], None], outage: OutageGuard,
                 backlog: Callable[[], int] = lambda: 0, yielding: Callable[[], object] = lambda: None) -> None:
        self._engine = engine
        # Truthy while this daemon leaves claims to others (supervisor/cycle/resealer.py:
        # it lacks the agreed encryption key and a live daemon has it).
        self._yielding = yielding
        # PostgreSQL: single statements in autocommit on the claimer's own driver connection
        # (supervisor/cycle/pgdirect.py). SQLite keeps its BEGIN IMMEDIATE transactions.
        self._direct = DirectConnection.of(engine, settings)
        # Outcomes waiting to be recorded still hold their leases and count against the
        # lease budget, so a completer that falls behind slows claiming instead of letting
        # leases pile up (a crash would resend every one of them).
        self._backlog = backlog
        self._settings = settings
        self._daemon_id = daemon_id
        self._metrics = metrics
        self._attempt = attempt
        self._submit = submit
        self._outage = outage
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._budget = LEASE_ROUNDS * settings.endpoint_concurrency  # leases per origin (the claim's cap)
        self._dispatch = Dispatcher(
            concurrency=settings.concurrency, endpoint_concurrency=settings.endpoint_concurrency,
            lease_seconds=settings.lease_seconds,
            attempt_seconds=settings.connect_timeout_seconds + settings.read_timeout_seconds,
            start=self._begin, release=self._release)
        # Whether the last claim may have left due work behind (a full batch, or an origin at
        # its budget): only then can a freed slot make anything claimable. Otherwise what is
        # due was all taken, and only new work (a NOTIFY), the poll or a retry's time brings
        # more: a request ending is no reason to run the claim again.
        self._capped = True
        self._starved = False  # out of lease budget: a request ending or a flush may give some back
        self._wake = asyncio.Event()
        # Why the claimer was woken: news (new work, budget back, a breaker's verdict, stop),
        # which always earns a claim, or only origins whose queue ran low (``_refills``),
        # which earn one only if still low when the claimer gets to it (``_refill_wanted``).
        self._news = False
        self._refills: set[str] = set()
        self._stopping = asyncio.Event()  # set once: a stop cuts short the outage guard's wait
        self._log = structlog.get_logger("outboxd.claimer")

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def wake(self) -> None:
        """New work may be due now (a NOTIFY)."""
        self._news = True
        self._wake.set()

    def recorded(self, failures: Sequence[Claimed], tripped: Sequence[tuple[str, str]]) -> None:
        """The completer recorded a batch: ``tripped`` endpoints' breakers opened (what waits
        for them goes back unsent), and ``failures`` (retryable) free their slots.

        Only those change what the claim may take for an origin: a success's lease stopped
        counting there when its request ended (``Dispatcher.ended``). Recording does shrink the
        backlog, which is what a claimer out of lease budget waits for (``_starved``).
        """
        self._dispatch.tripped(tripped)
        self._dispatch.settled(failures)
        self._metrics.in_flight.set(self.in_flight)
        if self._starved or (self._capped and (failures or tripped)):
            self.wake()

    def _connection(self) -> AsyncContextManager[Any]:
        return nullcontext(self._direct) if self._direct is not None else self._engine.begin()

    async def aclose(self) -> None:
        if self._direct is not None:
            await self._direct.aclose()

    def stop(self) -> None:
        self._stopping.set()
        self.wake()

    async def run(self) -> None:
        contended = 0  # contended claims in a row
        while not self._stopping.is_set():
            # Every lease counts: requests open and messages waiting their turn, within two
            # rounds of the concurrency, and outcomes the completer has not recorded yet past
            # one round (one flush's worth is normal; more means it is behind): at most three
            # rounds of leases in all, whatever the completer does.
            concurrency = self._settings.concurrency
            free = (LEASE_ROUNDS * concurrency - self.in_flight - self._dispatch.queued
                    - max(self._backlog() - concurrency, 0))
            self._starved = free <= 0
            if self._starved:  # full, or the completer is behind: look again when either moves
                await self._sleep(BACKLOG_RECHECK_SECONDS)
                continue
            if self._yielding():
                await self._sleep(self._settings.poll_interval_seconds)
                continue
            limit = min(free, self._settings.claim_batch)
            timeout = self._settings.poll_interval_seconds
            try:
                batch = await self._claim(limit)
                contended = contended + 1 if batch.contended else 0  # contended: fewer than it meant to
                self._outage.ok(CLAIMING)
                if len(batch) == limit or contended == 1 or batch.retired:
                    continue  # more may be due (or was behind rows with nothing to send): claim again at once
                if contended:
                    # Another daemon's claims keep taking or holding the rows this one reads:
                    # there is due work, so the poll is too long to wait, but claiming again at
                    # once could spin on rows a long transaction keeps locked. Back off,
                    # doubling, with jitter so two daemons' claims drift apart.
                    backoff = CONTENDED_BACKOFF_SECONDS * 2 ** min(contended - 2, 16)
                    timeout = min(timeout, backoff * random.uniform(0.5, 1.0))
                elif not batch and not self._tasks and not self._dispatch.queued:
                    # idle: sleep until the earliest retry, at most a poll; claim again at once
                    # while a pile of arrivals is left to fold (left by hours without a daemon)
                    next_due, now, unfolded = await self._outlook()
                    if unfolded:
                        continue
                    if next_due is not None and next_due > now:
                        timeout = min(timeout, next_due - now)
                # A partial batch took everything that may go now; a NOTIFY, a request ending
                # with work left behind, the poll or the earliest retry brings the rest.
            except Exception as exc:
                await unless_stopped(self._stopping, self._outage.failed(CLAIMING, exc))
                continue
            await self._sleep(timeout)

    async def _sleep(self, timeout: float) -> None:
        """Wait up to ``timeout`` for news, or for a refill still wanted when it is looked at."""
        deadline = time.monotonic() + max(timeout, 0.001)
        while True:
            if not self._wake.is_set():
                try:
                    await asyncio.wait_for(self._wake.wait(), max(deadline - time.monotonic(), 0.001))
                except asyncio.TimeoutError:
                    pass
            self._wake.clear()
            wanted = self._news or self._refill_wanted() or time.monotonic() >= deadline
            self._news = False
            self._refills.clear()
            if wanted:
                return

    def _low(self, origin: str) -> bool:
        """Whether ``origin``'s queue runs low: half a round of its requests or less waiting."""
        return self._dispatch.waiting(origin) <= self._settings.endpoint_concurrency // 2

    def _refill_wanted(self) -> bool:
        """Whether an origin that asked for a refill still needs one. Requests that end while
        a claim is out ask for one, and that claim may already have refilled their origin:
        claiming again at once would take only the few slots freed meanwhile, at the full
        cost of a claim, where the next refill takes them along with the rest."""
        return self._capped and any(self._low(origin) for origin in self._refills)

    async def _claim(self, limit: int) -> ClaimedBatch:
        # What this process held per origin when the claim went out: the statement counted at
        # most that (requests may end while it runs), so an origin whose held plus claimed
        # reaches the budget may have had due work left behind.
        held = {origin: self._dispatch.held(origin) for origin in self._dispatch.origins()}
        # Stamped before the transaction opens: a lease is never older than its stamp, however
        # long the round trip or (SQLite) the wait for the write lock.
        sent = time.monotonic()
        with tracing.span("outboxd.claim", {"outboxd.limit": limit}):
            async with self._connection() as conn:
                batch = await store.claim(conn, limit=limit, lease_seconds=self._settings.lease_seconds,
                                          horizon_seconds=self._settings.retry_horizon_seconds,
                                          daemon_id=self._daemon_id, endpoint_concurrency=self._budget,
                                          held=held, sent=sent)
        self._metrics.claim_batch.observe(len(batch))
        for message in batch:
            held[message.origin or ""] = held.get(message.origin or "", 0) + 1
            sendable = await self._may_send(message)
            if sendable is not None:
                self._dispatch.add(sendable)
            else:  # another daemon took this endpoint's half-open probe, or the database failed to grant it
                self._release(message)
        self._capped = len(batch) >= limit or batch.contended or any(n >= self._budget for n in held.values())
        self._metrics.in_flight.set(self.in_flight)
        return batch

    async def _may_send(self, message: Claimed) -> Claimed | None:
        """The message if it may go now (marked when it holds its endpoint's probe), else ``None``:
        it always may, unless it is its endpoint's probe.

        The claim returns an endpoint whose breaker is open or half-open only once the
        open period is over, and then one message: it goes if this daemon wins the probe.
        A probe the database fails to grant is not won: that message goes back, and the rest
        of the batch goes on (a batch left leased but never started would be rescued as
        ``abandoned`` attempts no receiver ever saw).
        """
        if message.breaker_state in (None, CircuitState.CLOSED.value):
            return message
        try:
            async with self._connection() as conn:
                origin = message.origin or ""
                before = await breaker_rows.acquire_probe(conn, message.tenant_id, origin,
                                                          self._settings.lease_seconds)
                if before is None:
                    return None
                now = await store.db_now(conn)
                await events.probe_taken(conn, message.tenant_id, origin, message.breaker_open_until, now)
                moves = [breaker_moves.move(message.tenant_id, origin, before, CircuitState.HALF_OPEN.value,
                                            open_until=message.breaker_open_until, daemon_id=self._daemon_id,
                                            now=now)] if before == CircuitState.OPEN.value else []
                await breaker_rows.insert_transitions(conn, moves)  # a move like any other
            breaker_moves.announce(moves, self._metrics, self._log)  # committed
            return dataclasses.replace(message, holds_probe=True)
        except Exception as exc:  # an outage shows in the next claim; this message is simply due again
            self._log.warning("probe.failed", tenant_id=message.tenant_id, origin=message.origin,
                              error=type(exc).__name__, detail=(str(exc).splitlines() or [""])[0][:200])
            return None

    def _release(self, message: Claimed) -> None:
        """Hand a leased message back untouched: no attempt made, none counted, due at once."""
        self._submit(Outcome(message, "release", "released"))

    def _begin(self, message: Claimed) -> None:
        self._tasks[message.id] = asyncio.create_task(self._run_attempt(message))

    async def _run_attempt(self, message: Claimed) -> None:
        outcome = Outcome(message, "retry", "abandoned", error="attempt interrupted at shutdown")
        try:
            outcome = await self._attempt(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must not lose the message: record and retry it
            self._log.exception("attempt.crashed", message_id=message.id)
            outcome = Outcome(message, "retry", "failed", error=f"internal error: {type(exc).__name__}")
        finally:
            self._tasks.pop(message.id, None)
            self._submit(outcome)  # noqa: B012 - recorded even when cancelled
            # A retryable failure keeps its slot until the breaker has judged it (recorded()).
            self._dispatch.ended(message, holds_slot=outcome.action == "retry")
            self._metrics.in_flight.set(self.in_flight)
            if self._starved:
                self.wake()  # budget came back
            elif self._capped and self._low(message.origin or ""):
                self._refills.add(message.origin or "")  # its queue runs low with work left behind
                self._wake.set()

    async def _outlook(self) -> tuple[float | None, float, bool]:
        async with self._connection() as conn:
            return await store.idle_outlook(conn)

    async def finish(self, grace: float) -> None:
        """Hand back what waits, wait up to ``grace`` seconds for attempts in flight, then
        interrupt the rest."""
        self._dispatch.release_all()
        tasks = list(self._tasks.values())
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
