"""The daemon's loops that write end between transactions at a stop (supervisor/cycle/halting.py).

On SQLite a loop cancelled inside a statement leaves the write lock with the connection
SQLAlchemy discards, and every later write waits out the busy timeout (30 s): the stop of
``outboxd run`` with it. Halted, the maintenance and recovery-job loops finish the
transaction under way (its write committed) and return at their next pause.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import text

from outbox.db import make_async_engine
from supervisor.cycle import job_runner, maintenance
from supervisor.cycle.halting import Halt
from supervisor.cycle.job_runner import JobRunner
from supervisor.cycle.maintenance import Maintenance
from supervisor.cycle.outage import OutageGuard
from supervisor.observe.metrics import Metrics

HOLD_SECONDS = 0.5


def _loop(name: str, engine, halt: Halt):
    if name == "maintenance":
        return Maintenance(engine, daemon_id="d1", metrics=Metrics(), outage=OutageGuard(5), horizon_seconds=86_400,
                           halt=halt)
    return JobRunner(engine, daemon_id="d1", horizon_seconds=86_400, outage=OutageGuard(5), halt=halt)


@pytest.mark.parametrize("name", ["maintenance", "jobs"])
def test_a_halted_loop_ends_after_the_transaction_under_way(sqlite_url, monkeypatch, name):
    engine = make_async_engine(sqlite_url)
    halt = Halt()
    in_transaction = asyncio.Event()

    async def held_step(*_args, **_kwargs) -> None:
        """The loop's first step: a write transaction that takes a while (a busy box's fsync)."""
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE IF NOT EXISTS test_held (n integer)"))
            await conn.execute(text("INSERT INTO test_held VALUES (1)"))
            in_transaction.set()
            await asyncio.sleep(HOLD_SECONDS)
        return None

    if name == "maintenance":
        monkeypatch.setattr(maintenance, "rescue_once", held_step)
    else:
        monkeypatch.setattr(job_runner.JobRunner, "_take", lambda self: held_step())

    async def run() -> float:
        try:
            task = asyncio.create_task(_loop(name, engine, halt).run())
            await asyncio.wait_for(in_transaction.wait(), 30)
            halt.set()
            started = time.monotonic()
            await asyncio.wait_for(task, 30)  # returns by itself: nothing cancels it
            took = time.monotonic() - started
            async with engine.begin() as conn:  # the write lock is free at once, and the write is there
                assert (await conn.execute(text("SELECT count(*) FROM test_held"))).scalar_one() == 1
            return took
        finally:
            await engine.dispose()

    took = asyncio.run(run())
    assert took < HOLD_SECONDS + 2, f"{name} took {took:.1f} s to end after the halt"


def test_a_halted_maintenance_loop_does_not_wait_for_a_slow_operator_event_sink(sqlite_url):
    """The tick's last step calls the operator event sinks, after its transaction: no write
    is under way, so a halt must not wait for them (up to the sink timeout per event and
    sink; the daemon's stop waited out its whole grace, 15 s by default)."""
    from outbox.config import Settings
    from outbox.migrate import upgrade
    from outbox.db import make_engine
    from supervisor.observe import events

    upgrade(make_engine(sqlite_url))
    engine = make_async_engine(sqlite_url)
    halt = Halt()
    called = asyncio.Event()

    async def slow_sink(event) -> None:
        called.set()
        await asyncio.sleep(10)

    async def run() -> float:
        try:
            await events.clock_skewed(engine, "an event to publish")
            loop = Maintenance(engine, daemon_id="d1", metrics=Metrics(), outage=OutageGuard(5),
                               horizon_seconds=86_400, settings=Settings(sink_timeout_seconds=10),
                               event_sinks=[slow_sink], halt=halt)
            task = asyncio.create_task(loop.run())
            await asyncio.wait_for(called.wait(), 30)
            halt.set()
            started = time.monotonic()
            await asyncio.wait_for(task, 90)
            return time.monotonic() - started
        finally:
            await engine.dispose()

    took = asyncio.run(run())
    assert took < 2, f"maintenance took {took:.1f} s to end after the halt"
