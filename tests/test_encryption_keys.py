"""The agreed encryption key (outbox/keyset.py) on a real database: when a new key may seal,
what holds it back, and what the producer's hot path pays for it."""

from __future__ import annotations

import asyncio
import base64
import os

from sqlalchemy import event, func, select, update

import outbox
from outbox.keyset import adopt, forget, read_ledger, report, sealer, stop_reporting
from outbox.schema import attempts, encryption_readers, messages
from outbox.sealing import sealing_keys


def key() -> bytes:
    return os.urandom(32)


def settle(engine, reader_id: str, keys, role: str = "daemon"):
    """One report and, for a daemon, one attempt to agree: (the agreed key id, the ledger)."""
    with engine.begin() as conn:
        ledger = report(conn, reader_id=reader_id, role=role, keys=keys)
        adopted = adopt(conn, ledger) if role == "daemon" else None
    return adopted or ledger.sealing_key_id, ledger


def test_a_new_key_seals_only_once_every_live_process_opens_it(engine):
    old, new = key(), key()
    before, during = sealing_keys(old), sealing_keys(new, (old,))
    assert settle(engine, "d1", before)[0] == before.active_id  # the first key is agreed at once
    agreed, _ = settle(engine, "p1", during, role="producer")  # rolled first: announces the new key
    assert agreed == before.active_id
    assert sealer(during, agreed).active_id == before.active_id  # and keeps sealing under the old one
    agreed, ledger = settle(engine, "d2", during)  # a rolled daemon cannot agree while d1 lacks the key
    assert agreed == before.active_id and ledger.lacking(during.active_id) == ["d1"]
    assert settle(engine, "d1", during)[0] == during.active_id  # the last process rolled: it seals
    assert sealer(during, during.active_id).active_id == during.active_id
    assert sealer(before, during.active_id).active_id == before.active_id  # a stale process seals its own


def test_a_stopped_process_stops_counting_at_once(engine):
    old, new = key(), key()
    settle(engine, "d1", sealing_keys(old))
    settle(engine, "d2", sealing_keys(new, (old,)))
    with engine.begin() as conn:
        assert read_ledger(conn).lacking(sealing_keys(new).active_id) == ["d1"]
        forget(conn, "d1")
        assert read_ledger(conn).lacking(sealing_keys(new).active_id) == []
    assert settle(engine, "d2", sealing_keys(new, (old,)))[0] == sealing_keys(new).active_id


def test_a_daemon_that_never_reported_holds_a_rotation_back(engine):
    """A previous release's daemon does not report: its recent attempts block the new key."""
    old, new = key(), key()
    settle(engine, "d1", sealing_keys(old))
    with engine.begin() as conn:
        conn.execute(attempts.insert().values(message_id=1, tenant_id="t", url="https://b.example/", attempt_number=1,
                                              outcome="success", will_retry=False, idempotency_key="k",
                                              trigger="scheduled", daemon_id="previous-release"))
    rotated = sealing_keys(new, (old,))
    assert settle(engine, "d1", rotated)[0] == sealing_keys(old).active_id
    with engine.begin() as conn:  # fifteen seconds later, nothing of it is recent any more
        conn.execute(update(attempts).values(occurred_at=attempts.c.occurred_at - 60))
    assert settle(engine, "d1", rotated)[0] == rotated.active_id


def test_an_enqueue_pays_no_round_trip_for_the_agreement(engine):
    settings = outbox.load_settings(env={"OUTBOX_ENCRYPTION_KEY": base64.b64encode(key()).decode()})
    statements: list[str] = []

    def enqueue(n: int) -> None:
        with engine.begin() as conn:
            outbox.enqueue(conn, tenant_id="t", url="https://buyer.example/hook", settings=settings,
                           payload={"n": n})

    enqueue(0)  # the first enqueue of a process reads and reports the agreement
    with engine.connect() as conn:
        [reader] = conn.execute(encryption_readers.select()).all()
    assert reader.role == "producer" and reader.sealing_key_id == settings.sealing().active_id
    event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    for n in range(1, 21):
        enqueue(n)
    assert not [s for s in statements if "outbox_encryption" in s]
    with engine.connect() as conn:  # each written: on PostgreSQL with its COMMIT, not as a statement of its own
        assert conn.execute(select(func.count()).select_from(messages)).scalar_one() == 21


def _seen_at(engine, reader_id: str) -> float:

    with engine.connect() as conn:
        return conn.execute(select(encryption_readers.c.seen_at)
                            .where(encryption_readers.c.reader_id == reader_id)).scalar_one()


async def test_a_daemon_keeps_reporting_while_a_long_re_seal_pass_waits(pg_engine, pg_url, monkeypatch):
    """A pass over a large table takes minutes; a daemon that stopped reporting meanwhile would
    drop out of the live readers, and a key it cannot open could be agreed. The pass here waits
    on a table lock; the reports must go on beside it."""
    import asyncio

    import psycopg

    from outbox.db import libpq_url, make_async_engine
    from supervisor.cycle import resealer as resealer_module
    from supervisor.cycle.outage import OutageGuard
    from supervisor.observe.metrics import Metrics

    with pg_engine.begin() as conn:  # plaintext rows: the agreed key's pass seals them
        for n in range(5):
            outbox.enqueue(conn, tenant_id="t", url="https://buyer.example.com/hook", payload={"n": n})
    settings = outbox.load_settings(env={"OUTBOX_DATABASE_URL": pg_url,
                                         "OUTBOX_ENCRYPTION_KEY": base64.b64encode(key()).decode()})
    monkeypatch.setattr(resealer_module, "REFRESH_SECONDS", 0.2)  # the pace, not what is under test
    engine = make_async_engine(pg_url)
    resealer = resealer_module.Resealer(engine, settings, reader_id="d1", outage=OutageGuard(30), metrics=Metrics())
    locker = await psycopg.AsyncConnection.connect(libpq_url(pg_url))
    try:
        await resealer.tick()
        assert resealer.agreed == settings.sealing().active_id
        await locker.execute("LOCK TABLE outbox_messages IN EXCLUSIVE MODE")  # the pass waits behind it
        running = asyncio.create_task(resealer.run())
        seen = []
        for _ in range(8):
            await asyncio.sleep(0.25)
            seen.append(_seen_at(pg_engine, "d1"))
        await locker.rollback()
        for _ in range(40):  # the pass goes on once the lock is gone
            if resealer._resealed_under == resealer.agreed:
                break
            await asyncio.sleep(0.1)
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    finally:
        await locker.close()
        await engine.dispose()
    assert len(set(seen)) >= 4, seen
    assert resealer._resealed_under == resealer.agreed


async def test_a_daemon_without_the_agreed_key_leaves_claims_to_one_that_has_it(engine, monkeypatch):
    from sqlalchemy import func, select

    from outbox.db import make_async_engine
    from outbox.schema import messages
    from supervisor.cycle.outage import OutageGuard
    from supervisor.cycle.resealer import Resealer
    from supervisor.observe.metrics import Metrics

    old, new = key(), key()
    url = engine.url.render_as_string(hide_password=False)
    settle(engine, "current", sealing_keys(old))
    rotated = sealing_keys(new, (old,))
    stale = outbox.load_settings(env={"OUTBOX_DATABASE_URL": url,
                                      "OUTBOX_ENCRYPTION_KEY": base64.b64encode(old).decode()})
    with engine.begin() as conn:  # sealed under the old key, still to move onto the new one
        outbox.enqueue(conn, tenant_id="t", url="https://buyer.example.com/hook", payload={"n": 1}, settings=stale)
    stop_reporting(engine)  # the producer is done: it no longer holds the rotation back
    assert settle(engine, "current", rotated)[0] == rotated.active_id  # every live process opens the new key
    metrics = Metrics()
    async_engine = make_async_engine(url)
    resealer = Resealer(async_engine, stale, reader_id="stale", outage=OutageGuard(30), metrics=metrics)
    try:
        await resealer.tick()
        assert resealer.agreed == rotated.active_id
        assert resealer.yielding is not None and rotated.active_id in resealer.yielding and "current" in resealer.yielding
        # the rotation's progress is the rows not under the agreed key, whichever key this daemon has
        with engine.connect() as conn:
            left = conn.execute(select(func.count()).where(messages.c.body_key_id != rotated.active_id)).scalar_one()
        assert left == 1 and metrics.reseal_backlog._value.get() == left
        with engine.begin() as conn:  # the daemon with the key stops: the stale one is all there is
            forget(conn, "current")
        await resealer.tick()
        assert resealer.yielding is None
    finally:
        await async_engine.dispose()


def test_a_stale_process_never_rolls_the_agreement_back(engine):
    """A key no process had sealed with before (a rotation's retired key kept only in
    OUTBOX_ENCRYPTION_OLD_KEYS), brought back as a stale process's own: announced, it would be
    the newest key, every process opens it, and it would be agreed again."""
    old, new = key(), key()
    rotated, stale = sealing_keys(new, (old,)), sealing_keys(old)
    assert settle(engine, "current", rotated)[0] == rotated.active_id
    agreed, ledger = settle(engine, "stale", stale)
    assert agreed == rotated.active_id and stale.active_id not in ledger.announced
    assert settle(engine, "current", rotated)[0] == rotated.active_id  # and no daemon agrees on it later
    assert sealer(stale, agreed).active_id == stale.active_id  # the stale process still seals with what it has


async def test_the_re_sealer_ends_with_the_outage_error_itself(monkeypatch):
    """Past the outage bound the daemon exits on DatabaseUnavailable (its last line, its exit
    status); the re-sealer's two loops must raise it as it is, not wrapped in a group."""
    import pytest

    from outbox.config import Settings
    from outbox.db import make_async_engine
    from supervisor.cycle.outage import DatabaseUnavailable, OutageGuard
    from supervisor.cycle.resealer import Resealer
    from supervisor.observe.metrics import Metrics

    engine = make_async_engine("postgresql+psycopg://postgres@127.0.0.1:1/nowhere")  # nothing listens on port 1
    resealer = Resealer(engine, Settings(), reader_id="d", outage=OutageGuard(0.2), metrics=Metrics())
    try:
        with pytest.raises(DatabaseUnavailable):
            await asyncio.wait_for(resealer.run(), 30)
    finally:
        await engine.dispose()


_STOP_DURING_A_TICK = """
import asyncio, json, os, sqlite3, threading, time
from contextlib import closing
from sqlalchemy import event, text
import outbox, outbox.db
from outbox.keyset import LIVE_SECONDS
from supervisor.cycle import resealer as resealer_module
from supervisor.cycle.daemon import Daemon

outbox.db.SQLITE_BUSY_TIMEOUT_MS = 5_000  # what a write behind a lock nobody releases waits (30 s shipped)
HOLD = 0.5  # the tick's transaction takes this long: on a busy box, its wait for the lock and its fsync
holding, armed = threading.Event(), threading.Event()

def hold():
    holding.set()
    time.sleep(HOLD)
    return 1

original_tick_step, original_run = resealer_module.unopenable_rows, resealer_module.Resealer.run

resealer_module.REFRESH_SECONDS = 0.2  # the pace of the ticks, not what is under test
ticks = []

async def unopenable_rows(conn, keys):  # inside the tick's transaction, its write lock taken
    if armed.is_set():
        ticks.append(1)
        if len(ticks) == 3:  # past the daemon's first moments: the claimer sleeps, not in the way
            await conn.execute(text("SELECT hold()"))
    return await original_tick_step(conn, keys)

async def run(self):  # the daemon's own ticks only, not the one while it starts
    armed.set()
    return await original_run(self)

resealer_module.unopenable_rows, resealer_module.Resealer.run = unopenable_rows, run

async def main():
    daemon = Daemon(outbox.load_settings(env=dict(os.environ)))
    event.listen(daemon.engine.sync_engine, "connect", lambda dbapi, _rec: dbapi.create_function("hold", 0, hold))
    stop = asyncio.Event()
    running = asyncio.create_task(daemon.run(stop))
    while not holding.is_set():  # SIGTERM lands while the tick runs its statement
        assert not running.done(), running
        await asyncio.sleep(0.01)
    stop.set()
    told = time.monotonic()
    await running
    took = time.monotonic() - told
    # read without a transaction: a write lock left behind must not fail the read itself
    path = daemon.settings.database_url.removeprefix("sqlite:///")
    with closing(sqlite3.connect(path)) as conn:
        [(seen_at,)] = conn.execute("SELECT seen_at FROM outbox_encryption_readers WHERE reader_id = ?",
                                    (daemon.daemon_id,)).fetchall()
    print(json.dumps({"took": took, "still_live": seen_at > time.time() - LIVE_SECONDS}))

asyncio.run(main())
"""


def test_a_stop_during_the_re_sealers_tick_leaves_at_once_and_stops_counting_on_sqlite(sqlite_url, tmp_path):
    """SIGTERM during the daemon's tick (the one at start: ``outboxd run`` stopped right after
    it started, on a busy box). Cancelled inside its statement, the tick had SQLAlchemy
    discard its aiosqlite connection, which kept SQLite's write lock: the re-sealer's own
    stop then waited out the busy timeout (30 s, a stop past the manifests' grace), failed,
    and left the daemon counted as a live reader. Halted, it ends with its transaction."""
    import json
    import subprocess
    import sys

    from tests import procs

    key_file, _ = procs.make_key(tmp_path)
    env = procs.daemon_env(sqlite_url, key_file, poll_interval_seconds=30)  # the claimer idle: not in the way
    env = {k: v for k, v in env.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", _STOP_DURING_A_TICK], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert not outcome["still_live"], outcome  # the stop's forget() was written
    assert outcome["took"] < 4.0, outcome  # the tick's 0.5 s, not the 5 s busy timeout
