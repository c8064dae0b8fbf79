"""Database faults under a real daemon: restarts, a long outage, and failing outcome writes.

Every test here runs against a private PostgreSQL cluster (``tests/pgcluster.py``) that it
may stop, crash or restart; the machine's shared server is never touched. The daemon is
the real ``outboxd run`` process and the buyers are the real receiver process.

What is proven, each by its own test:

* PostgreSQL restarted (cleanly, then crashed) while messages flow: the daemon reconnects
  and goes on without exiting, nothing is lost, nothing is marked delivered that the
  receiver did not accept, and every attempt is in the log;
* the database gone for longer than ``OUTBOX_DATABASE_OUTAGE_SECONDS``: the daemon says so
  in one clear log line and one stderr line and exits non-zero; a new daemon started when
  the database is back finishes every message;
* an error while recording an outcome (a trigger on ``outbox_attempts`` that raises for
  one tenant's successes): those messages stay leased, are retried after the lease, are
  never marked delivered while the error lasts, never lost and never recorded twice, and
  other tenants' deliveries go on undisturbed (each sent exactly once);
* the same refusal in process on SQLite and PostgreSQL: the completer isolates the refused
  outcome, the rescuer logs it ``abandoned``, a late retry of it changes nothing;
* shutdown: the drain records a batch the completer had already taken off its queue;
* SIGTERM while the database is away at start (a pod restarted during an outage): the
  daemon stops at once with status 0, not when the outage bound ends;
* SIGTERM while the database is away mid-run: the daemon waits for it no longer than the
  shutdown grace, exits non-zero naming the outcomes it could not record, and a new daemon
  finishes every message once the database is back.

``check_ledger`` (tests/ledger.py) holds the end-of-run invariants.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import psycopg
import pytest
from sqlalchemy import Engine

import outbox
from outbox.db import make_engine
from tests import procs
from tests.ledger import (arrivals_by_key, check_ledger, daemon_events, enqueue_batch, exit_line, finished,
                          load_attempts, load_messages, message_key, states)

pytestmark = pytest.mark.e2e


class World(NamedTuple):
    """A migrated database on the test's private cluster, the receiver and the daemon's log."""

    url: str
    engine: Engine
    pem: Path
    base: str  # the receiver, verifying every signature with the http-message-signatures library
    arrivals_log: Path
    log: Path  # where the test's daemon writes


@pytest.fixture
def world(cluster, tmp_path: Path, keypair) -> Iterator[World]:
    pem, jwks = keypair
    url = cluster.migrated_database()
    engine = make_engine(url, pool_pre_ping=True)
    with procs.receiver(tmp_path, jwks, verifier="library") as (port, arrivals_log):
        yield World(url, engine, pem, f"http://127.0.0.1:{port}", arrivals_log, tmp_path / "daemon.log")
    engine.dispose()


def _nothing_lost(world: World, total: int, directory: Path, **env: object) -> None:
    """After a daemon ended with the database away: its log has no traceback, and a new
    daemon (``env``: its settings), with the database back, delivers every one of ``total``
    messages, each once and verified (``check_ledger``)."""
    assert "Traceback" not in world.log.read_text(errors="replace")
    assert states(world.engine)["delivered"] < total, "the outage came too late to prove anything"
    daemon = procs.start_daemon(procs.daemon_env(world.url, world.pem, **env), directory / "daemon2.log")
    try:
        assert procs.wait_until(lambda: finished(world.engine, total, final=("delivered",)), 90), states(world.engine)
    finally:
        assert procs.stop(daemon) == 0
    assert check_ledger(world.engine, [world.arrivals_log])["delivered"] == total


# ---------------------------------------------------------------------------------------
# PostgreSQL restarted during a run.

def test_daemon_rides_out_postgresql_restarts(world, cluster):
    url, engine, pem, base, arrivals_log, log = world
    endpoints = {"t-ok": "/ok", "t-flaky": "/flaky/1", "t-down": "/status/500", "t-ok2": "/ok?x=1"}
    # Breakers are not the subject here: keep them closed so /flaky/1 converges quickly.
    env = procs.daemon_env(url, pem, database_outage_seconds=20, breaker_failure_threshold=10_000, concurrency=32)
    daemon = procs.start_daemon(env, log)
    try:
        counter = iter(range(10 ** 6))

        def produce(n: int) -> None:
            for _ in range(n // 20):
                batch = []
                for _ in range(20):
                    i = next(counter)
                    tenant = list(endpoints)[i % len(endpoints)]
                    batch.append((tenant, base + endpoints[tenant], message_key("rs", i)))
                enqueue_batch(engine, batch)

        produce(200)
        assert procs.wait_until(lambda: states(engine)["delivered"] >= 40, 30)
        cluster.restart("fast")  # a clean restart: every session is ended
        produce(200)
        assert procs.wait_until(lambda: states(engine)["delivered"] >= 200, 60)
        cluster.restart("immediate", down_seconds=3)  # a crash, down for 3 s (under the deadline)
        produce(200)
        total = next(counter)
        done = lambda: states(engine)["delivered"] == total * 3 // 4  # noqa: E731
        assert procs.wait_until(done, 90), states(engine)
        assert daemon.poll() is None, f"the daemon exited: {exit_line(log)}"
        events = {e.get("event") for e in daemon_events(log)}
        assert "database.error" in events and "database.recovered" in events
        assert "database.unreachable" not in events
    finally:
        rc = procs.stop(daemon)
    assert rc == 0, exit_line(log)
    down = [m.idempotency_key for m in load_messages(engine).values() if m.tenant_id == "t-down"]
    summary = check_ledger(engine, [arrivals_log], never_delivered=down)
    assert summary["delivered"] == total * 3 // 4 and summary["pending"] == total // 4, summary


# ---------------------------------------------------------------------------------------
# The database gone for longer than the deadline.

def test_daemon_exits_nonzero_after_the_outage_deadline(world, cluster, tmp_path):
    url, engine, pem, base, _, log = world
    deadline = 3
    total = 400
    for start in range(0, total, 100):  # /flaky/2: three attempts each, so work is in flight for a while
        enqueue_batch(engine, [(f"t{i % 4}", f"{base}/flaky/2", message_key("dl", i))
                               for i in range(start, start + 100)])
    env = procs.daemon_env(url, pem, database_outage_seconds=deadline, retry_base_seconds=0.2,
                           retry_max_seconds=0.5, breaker_failure_threshold=10_000)
    daemon = procs.start_daemon(env, log)
    try:
        assert procs.wait_until(lambda: states(engine)["delivered"] >= 20, 60)
        engine.dispose()
        cluster.stop("fast")
        stopped = time.monotonic()
        rc = daemon.wait(deadline + 30)
        took = time.monotonic() - stopped
    except subprocess.TimeoutExpired:
        daemon.kill()
        raise
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGKILL)
        if not cluster.is_running():
            cluster.start()
    assert rc != 0, "the daemon must exit non-zero when the database stays away"
    assert deadline - 1 <= took <= deadline + 15, f"exited {took:.1f} s after the database went away"
    line = exit_line(log)
    assert "database unreachable for" in line, f"no one-line reason on stderr: {line!r}"
    critical = [e for e in daemon_events(log) if e.get("event") == "database.unreachable"]
    assert (critical and critical[0]["level"] == "critical"
            and critical[0]["outage_seconds"] >= deadline)  # logged rounded to 0.1 s
    _nothing_lost(world, total, tmp_path, retry_base_seconds=0.2, retry_max_seconds=0.5,
                  breaker_failure_threshold=10_000)


# ---------------------------------------------------------------------------------------
# An error while recording an outcome.

POISON_TRIGGER = """
CREATE FUNCTION outbox_test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'test: refusing to record a success for %', NEW.idempotency_key;
END $$;
CREATE TRIGGER outbox_test_refuse BEFORE INSERT ON outbox_attempts
    FOR EACH ROW WHEN (NEW.tenant_id = 'poison' AND NEW.outcome = 'success')
    EXECUTE FUNCTION outbox_test_refuse();
"""


def test_recording_error_leaves_message_leased_then_retried_once_recorded(world):
    url, engine, pem, base, arrivals_log, log = world
    lease = 5
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(POISON_TRIGGER)
    # Poisoned messages are spread among healthy ones, so claims and outcome batches mix them.
    items = [("poison" if i % 20 == 0 else f"healthy-{i % 3}", f"{base}/ok", message_key("rec", i))
             for i in range(300)]
    enqueue_batch(engine, items)
    poison = {key for tenant, _, key in items if tenant == "poison"}
    env = procs.daemon_env(url, pem, lease_seconds=lease, database_outage_seconds=lease)
    daemon = procs.start_daemon(env, log)
    try:
        def arrived() -> set[str]:
            return set(arrivals_by_key(arrivals_log))

        assert procs.wait_until(lambda: poison <= arrived(), 30), "poisoned messages were never sent"
        # While outcomes cannot be recorded: leased or pending again, never delivered, never dead.
        seen_leased = False
        refused_until = time.monotonic() + 2.5 * lease
        while time.monotonic() < refused_until:
            stored = load_messages(engine)
            for key in poison:
                assert stored[key].state in ("in_flight", "pending"), (key, stored[key].state)
                seen_leased |= stored[key].state == "in_flight"
            time.sleep(0.25)
        assert seen_leased, "a message whose outcome could not be recorded must stay leased"
        by_key = arrivals_by_key(arrivals_log)
        assert any(len(by_key[k]) >= 2 for k in poison), "retried after the lease ran out"
        healthy = {k for _, _, k in items} - poison
        assert all(load_messages(engine)[k].state == "delivered" for k in healthy), \
            "other tenants' outcomes must be recorded while one tenant's cannot"
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DROP TRIGGER outbox_test_refuse ON outbox_attempts")
        assert procs.wait_until(lambda: finished(engine, len(items), final=("delivered",)), 60), states(engine)
        assert daemon.poll() is None, f"a recording error is not a database outage: {exit_line(log)}"
    finally:
        rc = procs.stop(daemon)
    assert rc == 0
    summary = check_ledger(engine, [arrivals_log])
    assert summary["delivered"] == len(items)
    stored, by_key = load_messages(engine), arrivals_by_key(arrivals_log)
    rows = load_attempts(engine)
    for key in poison:
        outcomes = [r.outcome for r in rows[stored[key].id]]
        assert outcomes[-1] == "success" and "abandoned" in outcomes, (key, outcomes)
    resent_healthy = [k for k in healthy if len(by_key[k]) != 1]
    assert not resent_healthy, f"{len(resent_healthy)} healthy messages were sent more than once"


# ---------------------------------------------------------------------------------------
# The same refusal, in process and on both databases: the completer's isolation itself.

SQLITE_POISON_TRIGGER = """
CREATE TRIGGER outbox_test_refuse BEFORE INSERT ON outbox_attempts
WHEN NEW.tenant_id = 'poison' AND NEW.outcome = 'success'
BEGIN SELECT RAISE(ABORT, 'test: refusing to record a success'); END;
"""


async def test_completer_isolates_an_outcome_the_database_refuses(any_url):
    from outbox import store
    from outbox.db import make_async_engine
    from sinks.fanout import SinkFanout
    from supervisor.cycle.attempt import Outcome
    from supervisor.cycle.completer import Completer
    from supervisor.cycle.maintenance import rescue_once
    from supervisor.observe.metrics import Metrics
    from supervisor.cycle.outage import OutageGuard

    sync = make_engine(any_url)
    enqueue_batch(sync, [("poison" if i in (3, 17) else "healthy", "https://buyer.example.com/hook",
                          message_key("unit", i)) for i in range(40)])
    pg = any_url.startswith("postgresql")
    if pg:
        with psycopg.connect(any_url, autocommit=True) as conn:
            conn.execute(POISON_TRIGGER)
    else:
        with sync.begin() as conn:
            conn.exec_driver_sql(SQLITE_POISON_TRIGGER)
    engine = make_async_engine(any_url)
    settings = outbox.load_settings(env={"OUTBOX_DATABASE_URL": any_url})
    outage = OutageGuard(0.5)  # a refusal mistaken for an outage would raise DatabaseUnavailable
    fanout = SinkFanout([], timeout=1)
    completer = Completer(engine, settings=settings, daemon_id="unit", metrics=Metrics(), fanout=fanout,
                          outage=outage)
    try:
        async with engine.begin() as conn:
            claimed = await store.claim(conn, limit=100, lease_seconds=0.5, horizon_seconds=86_400,
                                        endpoint_concurrency=1000,
                                        daemon_id="unit")
        assert len(claimed) == 40
        await completer._flush_until_done([Outcome(m, "delivered", "success", http_status=200, sent=True)
                                           for m in claimed])
        stored = load_messages(sync)
        poison = {k for k, m in stored.items() if m.tenant_id == "poison"}
        assert len(poison) == 2
        for key, m in stored.items():
            assert m.state == ("in_flight" if key in poison else "delivered"), (key, m.state)
        rows = load_attempts(sync)
        assert all(stored[k].id not in rows for k in poison), "no attempt row for a refused outcome"
        assert all(len(rows[m.id]) == 1 for k, m in stored.items() if k not in poison)
        # The lease runs out: the rescuer logs the cut-short attempt and makes it due again.
        time.sleep(0.6)
        assert await rescue_once(engine, "unit", 0.5) == 2
        with sync.begin() as conn:
            conn.exec_driver_sql("DROP TRIGGER outbox_test_refuse" + (" ON outbox_attempts" if pg else ""))
        async with engine.begin() as conn:
            again = await store.claim(conn, limit=100, lease_seconds=30, horizon_seconds=86_400, daemon_id="unit",
                                      endpoint_concurrency=1000)
        assert {m.idempotency_key for m in again} == poison and all(m.attempt == 2 for m in again)
        await completer._flush_until_done([Outcome(m, "delivered", "success", http_status=200, sent=True)
                                           for m in again])
        # A late retry of the first, refused outcome changes nothing (the lease token fences it).
        stale = [Outcome(m, "delivered", "success", http_status=200, sent=True) for m in claimed
                 if m.idempotency_key in poison]
        await completer._flush_until_done(stale)
        stored, rows = load_messages(sync), load_attempts(sync)
        assert all(m.state == "delivered" for m in stored.values())
        for key in poison:
            assert [(r.attempt_number, r.outcome) for r in rows[stored[key].id]] == [(1, "abandoned"),
                                                                                     (2, "success")]
    finally:
        await engine.dispose()
        sync.dispose()


async def test_drain_at_shutdown_records_the_batch_being_flushed(any_url):
    """SIGTERM: the daemon drains the completer, then cancels it. A batch the completer had
    already taken off its queue (collecting or flushing) must be recorded by the drain, not
    lost with the cancelled task (found by the restart test: after a clean stop a message
    was left ``in_flight`` with an unrecorded attempt)."""
    import asyncio

    from outbox import store
    from outbox.db import make_async_engine
    from sinks.fanout import SinkFanout
    from supervisor.cycle.attempt import Outcome
    from supervisor.cycle.completer import Completer
    from supervisor.observe.metrics import Metrics
    from supervisor.cycle.outage import OutageGuard

    sync = make_engine(any_url)
    enqueue_batch(sync, [("t1", "https://buyer.example.com/hook", message_key("drain", i)) for i in range(10)])
    engine = make_async_engine(any_url)
    completer = Completer(engine, settings=outbox.load_settings(env={"OUTBOX_DATABASE_URL": any_url}),
                          daemon_id="unit", metrics=Metrics(), fanout=SinkFanout([], timeout=1),
                          outage=OutageGuard(5))
    entered, release = asyncio.Event(), asyncio.Event()
    real_flush = completer.flush

    async def slow_flush(batch):  # the database is slow to answer this one
        entered.set()
        await release.wait()
        await real_flush(batch)

    completer.flush = slow_flush  # type: ignore[method-assign]
    runner = asyncio.create_task(completer.run())
    try:
        async with engine.begin() as conn:
            claimed = await store.claim(conn, limit=10, lease_seconds=30, horizon_seconds=86_400, daemon_id="unit",
                                        endpoint_concurrency=1000)
        for m in claimed:
            completer.submit(Outcome(m, "delivered", "success", http_status=200, sent=True))
        await asyncio.wait_for(entered.wait(), 5)
        assert completer.backlog == 10, "outcomes being recorded still hold their leases"
        asyncio.get_running_loop().call_later(0.2, release.set)
        await asyncio.wait_for(completer.drain(), 10)  # what the daemon does at shutdown...
    finally:
        runner.cancel()  # ...before it cancels the completer
        await asyncio.gather(runner, return_exceptions=True)
        await engine.dispose()
    counts = states(sync)
    sync.dispose()
    assert counts == {"delivered": 10}, counts


# ---------------------------------------------------------------------------------------
# Told to stop while the database is away.

def _at_defaults(env: dict[str, str], *names: str) -> dict[str, str]:
    """``env`` without the test tunings ``names`` (``OUTBOX_*``): those settings at their defaults."""
    return {k: v for k, v in env.items() if k not in names}


def _sigterm_a_second_after(daemon: subprocess.Popen[bytes], fault: Callable[[], None]) -> tuple[int, float]:
    """Bring ``fault`` about, SIGTERM the daemon a second later: its exit status, and how long
    after SIGTERM it came."""
    try:
        fault()
        time.sleep(1.0)  # into the back-off between tries, and requests end meanwhile
    finally:
        rc, took = procs.stop_timed(daemon)
    return rc, took


def test_sigterm_while_the_database_is_away_at_start_stops_the_daemon_at_once(tmp_path):
    """With every setting at its default (the outage bound is 60 s), a daemon that cannot
    reach its database yet stops on SIGTERM within seconds: nothing was claimed, so there is
    nothing to finish, and Kubernetes would otherwise kill it after its grace period."""
    key, _ = procs.make_key(tmp_path)
    env = _at_defaults(procs.daemon_env(f"postgresql://postgres@127.0.0.1:{procs.free_port()}/outboxd", key),
                       "OUTBOX_CONNECT_TIMEOUT_SECONDS", "OUTBOX_READ_TIMEOUT_SECONDS", "OUTBOX_LEASE_SECONDS",
                       "OUTBOX_SHUTDOWN_GRACE_SECONDS")
    log = tmp_path / "daemon.log"

    def database_away() -> None:
        assert procs.wait_until(lambda: "database.error" in [e.get("event") for e in daemon_events(log)], 30)
        time.sleep(3)  # deep into the back-off: its waits are over a second long by now

    rc, took = _sigterm_a_second_after(procs.start_daemon(env, log), database_away)
    seen = [e.get("event") for e in daemon_events(log)]
    # 0.16 s on an idle 2-core box; a second means something waited (a settle, a back-off).
    assert rc == 0 and took < 1.0, f"exit {rc} {took:.2f} s after SIGTERM; events {seen}"
    assert "daemon.stopped" in seen and "database.unreachable" not in seen, seen
    assert "Traceback" not in log.read_text(errors="replace")


def test_sigterm_while_the_database_is_away_mid_run_ends_within_the_grace(world, cluster, tmp_path):
    """The shutdown grace is the default (15 s); the shipped manifests allow 30 s before
    SIGKILL, where the outage bound (60 s) would have had the daemon killed mid-way."""
    url, engine, pem, base, _, log = world
    total = 400
    enqueue_batch(engine, [(f"t{i % 4}", f"{base}/delay/300", message_key("term", i))
                           for i in range(total)])

    def database_goes_away() -> None:
        assert procs.wait_until(lambda: states(engine)["delivered"] >= 20, 60)
        engine.dispose()
        cluster.stop("fast")

    try:
        rc, took = _sigterm_a_second_after(
            procs.start_daemon(_at_defaults(procs.daemon_env(url, pem), "OUTBOX_SHUTDOWN_GRACE_SECONDS"), log),
            database_goes_away)
    finally:
        if not cluster.is_running():
            cluster.start()
    print(f"\nSIGTERM with the database away: exit {rc} after {took:.1f} s; {exit_line(log)}")
    assert rc != 0 and took <= 15 + 5, f"exit {rc} {took:.1f} s after SIGTERM"
    assert "outcome(s) unrecorded" in exit_line(log), exit_line(log)
    _nothing_lost(world, total, tmp_path)


async def test_a_rescued_lease_names_the_daemon_that_held_it_and_starts_when_its_lease_began(any_url):
    from sqlalchemy import select

    from outbox import store
    from outbox.db import make_async_engine
    from outbox.schema import attempts
    from supervisor.cycle.maintenance import rescue_once

    sync = make_engine(any_url)
    enqueue_batch(sync, [("t1", "https://buyer.example.com/hook", message_key("rescued", i)) for i in range(3)])
    engine = make_async_engine(any_url)
    try:
        async with engine.begin() as conn:
            claimed = await store.claim(conn, limit=10, lease_seconds=0.5, horizon_seconds=86_400,
                                        endpoint_concurrency=10, daemon_id="daemon-that-died")
        assert len(claimed) == 3
        time.sleep(0.8)
        assert await rescue_once(engine, "rescuer", 0.5) == 3
        with sync.connect() as conn:
            rows = conn.execute(select(attempts.c.error, attempts.c.response_time_ms, attempts.c.occurred_at,
                                       attempts.c.daemon_id)).all()
    finally:
        await engine.dispose()
        sync.dispose()
    assert len(rows) == 3
    for error, elapsed_ms, occurred_at, daemon_id in rows:
        assert error == "lease of daemon daemon-that-died expired; outcome unknown" and daemon_id == "rescuer"
        started = occurred_at - elapsed_ms / 1000  # what webhook_activity gives as the attempt's fired_at
        assert abs(started - claimed[0].claimed_at) < 0.05 and elapsed_ms >= 800, (started, claimed[0].claimed_at)
