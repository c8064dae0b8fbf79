"""``outboxd run``: the daemon, wired from its small parts.

    claimer ──► attempt (sign · POST · classify) ──► completer ──► sinks
       ▲  wake-up (LISTEN / poll)     maintenance (rescue · expire · gauges)   health/metrics

Every decision that must survive a crash is written by the completer in the database; this
process only caches. SIGTERM/SIGINT stop claiming, let in-flight attempts finish within
``OUTBOX_SHUTDOWN_GRACE_SECONDS``, record them (interrupted ones as ``abandoned``, due
again at once), and exit 0; a database away then is waited for only until the grace has
passed, and one away at start not at all (docs/operations.md, "Stopping").
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.config import Settings
from outbox.db import connect_options, error_line, is_postgresql, make_async_engine, reading
from sinks.fanout import SinkFanout, load_sink
from sinks.structlog_sink import StructlogSink
from outbox.leases import Claimed
from outbox.subscribers import sending_to
from supervisor.observe import events, tracing
from supervisor.cycle.attempt import Outcome, attempt
from supervisor.cycle.claimer import Claimer
from supervisor.cycle.clock import ClockOffsetError, DatabaseClock
from supervisor.cycle.completer import Completer
from supervisor.observe.health import READY_CHECK_SECONDS, HealthServer
from supervisor.cycle.halting import Halt
from supervisor.cycle.job_runner import JobRunner
from supervisor.keys.keyring import CHANNEL as KEYRING_CHANNEL
from supervisor.keys.keyring_cache import CachedKeyring
from supervisor.cycle.maintenance import Maintenance
from supervisor.observe.metrics import Metrics
from supervisor.cycle.outage import DatabaseUnavailable, OutageGuard, unless_stopped
from supervisor.cycle.reporting_handoff import run_handoff
from supervisor.cycle.resealer import Resealer, held_line
from supervisor.cycle.schema_watch import schema_check, wait_for_schema, watch_schema
from outbox.bodies import encryption_summary
from supervisor.wire.transport import HttpSender
from supervisor.cycle.cutoff import Cutoff
from supervisor.cycle.pgdirect import check_each_connection, startup_options
from supervisor.cycle.wakeup import listen, listen_url


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where it is installed (a dependency on CPython/POSIX), else asyncio's own loop.

    The event loop is about a quarter of the daemon's CPU per delivery; uvloop's is cheaper
    (docs/performance.md has the measurement).
    """
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def new_daemon_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


# After SIGTERM, recording what the attempts left waits for a database that is away until the
# shutdown grace has passed, and at least this long (docs/operations.md, "Stopping").
RECORDING_FLOOR_SECONDS = 5.0


def daemon_engine(settings: Settings) -> AsyncEngine:
    """The daemon's SQLAlchemy engine: on PostgreSQL with the timeouts and keepalives of
    :func:`outbox.db.connect_options` and the startup options of
    :func:`supervisor.cycle.pgdirect.startup_options`, checked on each new connection."""
    if not is_postgresql(settings.database_url):
        return make_async_engine(settings.database_url)
    engine = make_async_engine(settings.database_url,
                               connect_args={**connect_options(settings), **startup_options(settings)})
    check_each_connection(engine, settings)
    return engine


class Daemon:
    def __init__(self, settings: Settings, *, sender: HttpSender | None = None,
                 metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.daemon_id = new_daemon_id()
        self.metrics = metrics or Metrics(per_tenant=settings.per_tenant_metrics,
                                          endpoint_top=settings.endpoint_metrics_top)
        self.engine = daemon_engine(settings)
        self.cutoff = Cutoff.of(self.engine)
        self.keys = CachedKeyring(settings, on_scopes=self._count_signing_keys)
        self.sender = sender or HttpSender(settings)
        self.outage = OutageGuard(settings.database_outage_seconds, on_outage=self.metrics.database_outages.inc,
                                  on_error=lambda cause: self.metrics.database_errors.labels(cause=cause).inc(),
                                  quiet=lambda: self.cutoff.is_cut)
        self.fanout = SinkFanout([StructlogSink(), *(load_sink(p) for p in settings.sinks)],
                                 timeout=settings.sink_timeout_seconds,
                                 on_error=lambda name: self.metrics.sink_errors.labels(sink=name).inc())
        self.completer = Completer(self.engine, settings=settings, daemon_id=self.daemon_id, metrics=self.metrics,
                                   fanout=self.fanout, outage=self.outage,
                                   on_recorded=lambda failures, tripped: self.claimer.recorded(failures, tripped))
        self.clock = DatabaseClock()
        self.tracing = tracing.configure()
        self.event_sinks = events.load_sinks(settings.operator_event_sinks)
        self.claimer = Claimer(self.engine, settings=settings, daemon_id=self.daemon_id, metrics=self.metrics,
                               attempt=self._attempt(),
                               submit=self.completer.submit, outage=self.outage,
                               backlog=lambda: self.completer.backlog, yielding=lambda: self.resealer.yielding)
        self.halt = Halt()  # the loops that write end between transactions at a stop (supervisor/cycle/halting.py)
        self.resealer = Resealer(self.engine, settings, reader_id=self.daemon_id, outage=self.outage,
                                 metrics=self.metrics, halt=self.halt)
        self.health = HealthServer(self.metrics, self._problem, self.keys.documents(),
                                   notice=lambda: "; ".join(self.keys.paused().values()) or None)
        self.log = structlog.get_logger("outboxd").bind(daemon_id=self.daemon_id)
        self.metrics_address: tuple[str, int] | None = None

    def _count_signing_keys(self, scopes: dict[str, int]) -> None:
        """``outbox_signing_active_keys`` per scope (the alert on 0 says webhooks wait for a key)."""
        for scope, count in scopes.items():
            self.metrics.signing_active_keys.labels(scope=scope).set(count)

    async def _problem(self) -> str | None:
        """Why ``/readyz`` must fail now: an activity that keeps failing, the schema, messages
        held for an encryption key this process lacks, or deliveries left to daemons that have it."""
        return (self.outage.problem() or (await schema_check(self.engine, READY_CHECK_SECONDS)).problem()
                or held_line(self.resealer.unopenable) or self.resealer.yielding)

    def _attempt(self) -> Callable[[Claimed], Awaitable[Outcome]]:
        """One attempt of a claimed message; inside its span when tracing is on (supervisor/observe/tracing.py)."""
        settings = self.settings

        def send(m: Claimed) -> Awaitable[Outcome]:
            return attempt(m, settings=settings, keys=self.keys, sender=self.sender, clock=self.clock)

        def run(m: Claimed) -> Awaitable[Outcome]:  # the coroutine itself: no extra frame when tracing is off
            return send(m) if m.subscriber_ref is None else self._unless_revoked(m, send)

        return run if self.tracing is None else self.tracing.traced(run)

    async def _unless_revoked(self, m: Claimed, send: Callable[[Claimed], Awaitable[Outcome]]) -> Outcome:
        """A subscriber's fire, sent only if its subscriber is still registered and not paused.

        A fire may wait in memory for a slot, seconds after its claim (supervisor/cycle/dispatch.py),
        and a revocation meanwhile skips it (it is leased, not pending). Read as its request
        starts, so what a revocation finds unsent stays unsent: handed back here, the completer
        ends it dead ``cancelled`` (docs/reporting.md, "Revocation"). One read per fire, none
        for other messages."""
        try:
            async with reading(self.engine).connect() as conn:
                live = (await conn.execute(sending_to([m.subscriber_ref or 0]))).first() is not None
        except SQLAlchemyError as exc:
            return Outcome.held(m, f"its subscriber's state could not be read: {error_line(exc)}")
        if not live:
            return Outcome(m, "release", "released", error="subscriber removed or paused before sending")
        return await send(m)

    async def _measure_clock(self) -> None:
        try:
            await self.clock.measure(self.engine)
        except ClockOffsetError as exc:
            await self._clock_skewed(exc)
            raise

    async def _watch_clock(self) -> None:
        try:
            await self.clock.watch(self.engine, self.outage)
        except ClockOffsetError as exc:
            await self._clock_skewed(exc)
            raise

    async def _clock_skewed(self, exc: ClockOffsetError) -> None:
        """Tell the operators (best effort: the daemon stops either way)."""
        try:
            await events.clock_skewed(self.engine, str(exc))
            await events.publish_due(self.engine, self.settings, self.event_sinks, self.settings.sink_timeout_seconds)
        except Exception as failure:
            self.log.error("operator_event.unrecorded", kind="clock.skew", error=type(failure).__name__)

    async def _start(self, stop: asyncio.Event) -> bool:
        """Wait for the schema, then measure the clock, load the signing keys and report the
        encryption keys; ``False`` if asked to stop meanwhile.

        A database failure in any of these steps is ridden out like an outage at the schema
        check (counted by the outage guard, retried from the schema check, the daemon ending
        only past ``OUTBOX_DATABASE_OUTAGE_SECONDS``): a restart of the database while the
        daemon starts is not a reason to exit. A clock beyond tolerance or no key that can
        sign ends it: waiting cannot help."""
        while await wait_for_schema(self.engine, stop, outage=self.outage, cutoff=self.cutoff, log=self.log):
            try:
                await self._measure_clock()  # ClockOffsetError: never sign with a clock receivers reject
                await self.keys.start(self.engine)  # fails here, not on the first attempt, when no key can sign
                await self.resealer.tick()  # report the encryption keys before the first claim
            except SQLAlchemyError as exc:
                await unless_stopped(stop, self.outage.failed("start up", exc))
                continue
            self.outage.ok("start up")
            return True
        return False

    async def _record_the_rest(self, stopped_at: float, recorded_by: float) -> DatabaseUnavailable | None:
        """Record what the attempts left (:meth:`Completer.drain`) before the process ends.

        A database that is away is waited for until ``recorded_by`` (the loop's time; the
        stop began at ``stopped_at``), not for the outage bound: the supervisor's own grace
        (30 s in the shipped manifests) would end the process first. Then the connections are
        cut (:class:`Cutoff`). What is left unrecorded keeps its lease and is sent again once
        the lease runs out, as after a crash; the error returned says how many, for the exit
        line."""
        if not self.cutoff.is_cut and await self.cutoff.by(recorded_by, self.completer.drain()):
            return None
        return self._unrecorded(stopped_at)

    def _unrecorded(self, stopped_at: float, outage: DatabaseUnavailable | None = None) -> DatabaseUnavailable:
        """Log every outcome left unrecorded (:meth:`Completer.give_up`) and return the exit's
        error, saying how many: after a stop the database did not answer in time for, or after
        an ``outage`` past its bound."""
        unrecorded = self.completer.give_up()
        if outage is not None and not unrecorded:
            return outage
        waited = asyncio.get_running_loop().time() - stopped_at
        self.log.error("daemon.unrecorded", outcomes=unrecorded, waited_seconds=round(waited, 1),
                       retry="after their leases expire")
        reason = str(outage) if outage is not None else f"the database did not answer within {waited:.0f} s of the stop"
        return DatabaseUnavailable(f"stopped with {unrecorded} outcome(s) unrecorded: {reason}; their messages are "
                                   "sent again once their leases expire")

    def _wakeups(self) -> list[asyncio.Task[Any]]:
        """LISTEN for new work and key changes where NOTIFY can arrive; else say, once, that
        this daemon polls (behind a transaction pooler without OUTBOX_LISTEN_DATABASE_URL)."""
        url = listen_url(self.settings)
        if url is None:
            self.log.warning("wakeup.polling", poll_interval_seconds=self.settings.poll_interval_seconds,
                             reason="NOTIFY cannot arrive through a transaction pooler "
                                    "(OUTBOX_DATABASE_POOLER=transaction): new work is found by polling",
                             hint="set OUTBOX_LISTEN_DATABASE_URL to a direct connection for millisecond wake-ups")
            return []
        options = connect_options(self.settings)
        return [asyncio.create_task(listen(url, self.claimer.wake, options=options, cutoff=self.cutoff),
                                    name="wakeup"),
                asyncio.create_task(listen(url, self.keys.wake, KEYRING_CHANNEL, options=options, cutoff=self.cutoff),
                                    name="keyring-wakeup")]

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        # SIGHUP too: an operator's closed terminal must drain as a stop does, not end the
        # process with leases held (there is no configuration to reload).
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        if self.settings.metrics_addr:  # up first, so /readyz explains a wait for the schema
            self.metrics_address = await self.health.start(self.settings.metrics_addr)
        ready = False
        try:
            ready = await self._start(stop)
        finally:
            if not ready:  # stopped while waiting, or refused: nothing else was started
                await self.health.close()
                await self.engine.dispose()
        if not ready:
            self.log.info("daemon.stopped")
            return
        # Everything made while starting (modules, SQL, settings: some 10^5 objects) lives as
        # long as the process; frozen, the collector stops rescanning it, and a full collection
        # during delivery takes about 2 ms instead of 55 ms (a pause every queue and request
        # in flight waited out).
        gc.collect()
        gc.freeze()
        tracing.install(self.tracing)
        self.fanout.start()
        halting = [  # the loops that write: halted at a stop, cancelled only past its time
            asyncio.create_task(Maintenance(self.engine, daemon_id=self.daemon_id, metrics=self.metrics,
                                            outage=self.outage, horizon_seconds=self.settings.retry_horizon_seconds,
                                            settings=self.settings, event_sinks=self.event_sinks,
                                            halt=self.halt).run(),
                                name="maintenance"),
            asyncio.create_task(JobRunner(self.engine, daemon_id=self.daemon_id, outage=self.outage,
                                          horizon_seconds=self.settings.retry_horizon_seconds, metrics=self.metrics,
                                          events_window=self.settings.operator_events_window_seconds,
                                          halt=self.halt).run(),
                                name="jobs"),
            asyncio.create_task(self.resealer.run(), name="resealer"),
        ]
        background: list[asyncio.Task[Any]] = [
            asyncio.create_task(self.completer.run(), name="completer"),
            asyncio.create_task(self.keys.run(self.engine, quiet=lambda: self.cutoff.is_cut), name="keyring"),
            asyncio.create_task(self._watch_clock(), name="clock"),
            asyncio.create_task(watch_schema(self.engine, within=READY_CHECK_SECONDS, log=self.log), name="schema"),
            *halting,
        ]
        handoff = None
        if self.settings.reporting_handoff:  # docs/reporting.md: the SDK's notifications, sent by outboxd
            handoff = asyncio.create_task(run_handoff(self.settings, self.metrics), name="reporting")
            background.append(handoff)
        if is_postgresql(self.settings.database_url):
            background.extend(self._wakeups())
        claimer = asyncio.create_task(self.claimer.run(), name="claimer")
        stopper = asyncio.create_task(stop.wait(), name="stop")
        self.log.info("daemon.started", concurrency=self.settings.concurrency,
                      metrics=self.metrics_address, horizon_seconds=self.settings.retry_horizon_seconds,
                      body_encryption=encryption_summary(self.settings, self.resealer.agreed),
                      held=held_line(self.resealer.unopenable))
        failure: BaseException | None = None
        try:
            done, _ = await asyncio.wait([claimer, stopper, *background], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper and task.exception() is not None:
                    failure = task.exception()
        finally:
            stopped_at = loop.time()
            grace_ends = stopped_at + self.settings.shutdown_grace_seconds
            self.log.info("daemon.stopping", in_flight=self.claimer.in_flight)
            self.claimer.stop()
            self.halt.set()
            if handoff is not None:
                # A stop needs no more hand-off turns, and one stuck on an unanswering database
                # takes psycopg up to 10 s to cancel (on the seller's pool, which the cut cannot
                # reach): begin that now, within the grace, not after it. A turn cut short is
                # handed off again by the next daemon, as after a crash (docs/reporting.md).
                handoff.cancel()
            outage = failure if isinstance(failure, DatabaseUnavailable) else None
            if outage is not None:  # past the outage bound: nothing to wait for
                self.cutoff.cut()
            await self.cutoff.by(grace_ends, asyncio.gather(claimer, return_exceptions=True))  # a claim unanswered
            recorded_by = grace_ends
            # The database answers after a stop, and after a clock found too far off (what is
            # in flight was signed with the database's time): requests finish and are recorded,
            # else their leases expire and they are sent again.
            if failure is None or isinstance(failure, ClockOffsetError):
                await self.claimer.finish(self.settings.shutdown_grace_seconds)
                recorded_by = max(grace_ends, loop.time() + RECORDING_FLOOR_SECONDS)
                failure = await self._record_the_rest(stopped_at, recorded_by) or failure
            # From here on nothing waits for the database past that time.
            cut = loop.call_at(recorded_by, self.cutoff.cut)
            # The loops that write were halted as the stop began: each ends with the transaction
            # under way, cancelled only if that outlasts the cut (on SQLite, a loop cancelled in
            # a statement keeps the write lock, and every later write waits out the busy timeout).
            # Then stop counting as an encryption-key reader.
            await asyncio.wait(halting, timeout=max(recorded_by - loop.time(), 0.0))
            for task in halting:
                task.cancel()
            await asyncio.gather(*halting, return_exceptions=True)
            await self.resealer.stop()
            for task in [stopper, *background]:
                task.cancel()
            await asyncio.gather(stopper, *background, return_exceptions=True)
            if outage is not None:  # what the outage left unrecorded, said (the completer is stopped now)
                failure = self._unrecorded(stopped_at, outage)
            await self.fanout.close()
            await self.health.close()
            await self.sender.aclose()
            await self.claimer.aclose()
            await self.completer.aclose()
            await self.engine.dispose()
            cut.cancel()
            tracing.install(None)
            if self.tracing is not None:
                await asyncio.to_thread(self.tracing.shutdown)  # export the last spans
        if failure is not None:
            raise failure  # DatabaseUnavailable, or a bug: exit non-zero so the supervisor restarts us
        self.log.info("daemon.stopped")
