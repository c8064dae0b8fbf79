"""outboxd behind a real PgBouncer in transaction mode (docs/pooler.md).

* Producers in 4 threads (a quarter of their transactions rolled back) on the seller's
  ordinary engine with the one documented ``connect_args``, ``outboxd migrate``, ``outboxd
  status`` and two daemons, all through PgBouncer; one daemon is SIGKILLed mid-run. Every
  committed message is delivered and recorded exactly once, verified, with its stored
  bytes; no rolled-back one is stored or sent; the 50 delivery reports arrive numbered
  1..50. Run with the direct LISTEN URL and without it (polling), printing the p50 from
  commit to arrival of each.
* With prepared statements left on (a pooler that ignores the startup options, no
  ``OUTBOX_DATABASE_POOLER``), the stall is not silent: ``/readyz`` fails naming the cause,
  the metric counts it, and the daemon exits non-zero within the outage bound.
* A pooler that refuses the startup options: the daemon says which setting is missing.
"""

from __future__ import annotations

import json
import random
import signal
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.engine import make_url

import outbox
from outbox.schema import messages
from tests import procs
from tests.ledger import (check_ledger, daemon_events, exit_line, finished, leased_by, load_messages,
                          message_key, PRODUCER)
from tests.pgbouncer import pgbouncer
from tests.procs import free_port

THREADS, TRANSACTIONS, REPORTS = 4, 40, 50
# One producer's receiver answers slowly, so a daemon holds leases for a while (and the kill
# cuts attempts short); the others answer at once.
SLOW_THREAD = 3


def seller_engine(url: str):
    """The seller's ordinary engine, with the README's one setting for a transaction pooler."""
    return create_engine(make_url(url).set(drivername="postgresql+psycopg"),
                         connect_args={"prepare_threshold": None})


class Producers:
    """4 threads of seller transactions: two messages each, and a delivery report while fewer
    than 50 are committed; one transaction in four is rolled back."""

    def __init__(self, engine, base: str) -> None:
        self.engine, self.base = engine, base
        self.committed: dict[str, float] = {}  # idempotency key -> commit time
        self.rolled_back: set[str] = set()
        self.reports = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def run(self, thread: int) -> None:
        rng = random.Random(thread)
        report_hook = {"url": f"{self.base}/ok?reports", "operation_id": "op_rep", "token": "reporttoken123456"}
        for n in range(TRANSACTIONS):
            keys = [message_key(f"p{thread}", 2 * n + i) for i in range(2)]
            url = f"{self.base}{'/delay/100' if thread == SLOW_THREAD else '/ok'}?t={thread}"
            roll_back = rng.random() < 0.25
            try:
                with self.engine.connect() as conn:
                    with conn.begin() as txn:
                        for key in keys:
                            outbox.enqueue(conn, tenant_id=f"t{thread % 2}", url=url,
                                           idempotency_key=key, payload={"n": n, "thread": thread}, settings=PRODUCER)
                        with self._lock:
                            report = roll_back or self.reports < REPORTS
                            self.reports += report and not roll_back
                        if report:
                            record = outbox.enqueue_delivery_report(
                                conn, tenant_id="t-reports", reporting_webhook=report_hook, media_buy_id="mb_1",
                                result={"notification_type": "scheduled", "currency": "USD",
                                        "reporting_period": {"start": "2026-11-01T00:00:00Z",
                                                             "end": "2026-11-02T00:00:00Z"},
                                        "media_buy_deliveries": []}, settings=PRODUCER)
                            keys.append(record.idempotency_key)
                        if roll_back:
                            txn.rollback()
                at = time.time()
                with self._lock:
                    if roll_back:
                        self.rolled_back.update(keys)
                    else:
                        self.committed.update(dict.fromkeys(keys, at))
            except Exception as exc:  # noqa: BLE001 - every failure is a finding of this test
                self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            time.sleep(0.1)

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self.run, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        return threads


def started(log: Path) -> bool:
    return any(e.get("event") == "daemon.started" for e in daemon_events(log))


def attempts_by(log: Path) -> int:
    return sum(e.get("event") == "delivery.attempt" for e in daemon_events(log))


def reported_numbers(log: Path) -> list[int]:
    """The distinct sequence numbers of the delivery reports the receiver accepted, in order
    (a report the killed daemon had in flight may arrive twice, with its one number)."""
    bodies = [json.loads(a["body"]) for a in procs.arrivals(log) if a["status"] == 200]
    return sorted({b["result"]["sequence_number"] for b in bodies if b.get("task_type") == "media_buy_delivery"})


@pytest.mark.parametrize("wakeup", ["listen", "poll"])
def test_two_daemons_behind_pgbouncer_deliver_every_commit_once(pg_server_url, fresh_db, tmp_path, wakeup):
    key, jwks = procs.make_key(tmp_path)
    with pgbouncer(pg_server_url) as bouncer:
        pooled = bouncer.url(fresh_db)
        extra = {"listen_database_url": fresh_db} if wakeup == "listen" else {}
        # The default poll interval (the tests' usual 0.5 s would flatter the polling latency).
        env = procs.daemon_env(pooled, key, database_pooler="transaction", poll_interval_seconds=1.0, **extra)
        procs.outboxd(env, "migrate", exit_code=0)
        engine = seller_engine(pooled)
        logs = [tmp_path / "a.log", tmp_path / "b.log"]
        with procs.receiver(tmp_path, jwks, verifier="adcp", log_bodies=True) as (port, arrivals_log):
            daemons = [procs.start_daemon(env, log) for log in logs]
            try:
                assert procs.wait_until(lambda: all(started(log) for log in logs), 60), daemon_events(logs[0])[-3:]
                producers = Producers(engine, f"http://127.0.0.1:{port}")
                threads = producers.start()
                # Killed mid-run: while the producers commit and it holds leases.
                assert procs.wait_until(lambda: attempts_by(logs[0]) >= 5 and leased_by(engine, daemons[0].pid), 40), \
                    daemon_events(logs[0])[-5:]
                assert procs.stop(daemons[0], signal.SIGKILL) == -signal.SIGKILL
                assert any(t.is_alive() for t in threads), "the producers were done before the kill"
                for t in threads:
                    t.join(60)
                assert not producers.errors, producers.errors[:3]
                total = len(producers.committed)
                assert procs.wait_until(lambda: finished(engine, total, final=("delivered",)), 40), \
                    (total, len(load_messages(engine)))
                assert daemons[1].poll() is None, daemon_events(logs[1])[-3:]
            finally:
                for d in daemons:
                    procs.stop(d)
            status = json.loads(procs.outboxd(env, "status", "--json", exit_code=0).stdout)
            summary = check_ledger(engine, [arrivals_log])
            assert status["messages"]["delivered"] == total  # the CLI through the pooler too
            stored = load_messages(engine)
            assert set(stored) == set(producers.committed), "stored messages differ from the committed ones"
            assert summary["delivered"] == total and summary["resent"] <= summary["abandoned"], summary
            arrived = {a["key"]: a["t"] for a in reversed(procs.arrivals(arrivals_log)) if a["status"] == 200}
            assert not producers.rolled_back & set(arrived), "a rolled-back message was sent"
            assert reported_numbers(arrivals_log) == list(range(1, REPORTS + 1))
            with engine.connect() as conn:
                numbers = conn.execute(select(messages.c.sequence_number).where(messages.c.tenant_id == "t-reports")
                                       .order_by(messages.c.sequence_number)).scalars().all()
            assert numbers == list(range(1, REPORTS + 1))
            slow = message_key(f"p{SLOW_THREAD}", 0)[:-8]  # the slow receiver's keys say nothing of wake-ups
            p50 = statistics.median(arrived[k] - t for k, t in producers.committed.items() if not k.startswith(slow))
            print(f"\nbehind PgBouncer ({wakeup}): {total} committed, {len(producers.rolled_back)} rolled back, "
                  f"{summary['abandoned']} abandoned by the killed daemon; p50 commit->arrival {p50 * 1000:.0f} ms")
            events = [e.get("event") for log in logs for e in daemon_events(log)]
            assert "database.error" not in events and "database.misconfigured" not in events
            if wakeup == "listen":
                assert "wakeup.polling" not in events
                assert p50 < 1.0, f"p50 {p50:.3f} s: NOTIFY did not wake the daemons"
            else:
                assert events.count("wakeup.polling") == 2  # once per daemon
            assert bouncer.unlinked_packets() == 0  # no LISTEN went through the pooler
        engine.dispose()


def metric(port: int, line_start: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(line_start):
                return float(line.split()[-1])
    return 0.0


def test_a_pooler_that_drops_the_startup_options_fails_readiness_at_once(pg_server_url, fresh_db, tmp_path):
    """A pooler that ignores the ``options`` startup parameter (a common setting) would let
    daemons started without OUTBOX_DATABASE_POOLER run on prepared statements that a pooled
    server connection may not hold; identical daemons can even find each other's twins and
    run for a long while. Each daemon reads a setting of its own back on every new
    connection, so it says so on its first one, even where the server's own statement_timeout
    is the very timeout the daemon's options would set. PgBouncer otherwise at its defaults,
    and two daemons, as an operator would run them."""
    import psycopg

    key, _ = procs.make_key(tmp_path)
    outage = 10
    with psycopg.connect(pg_server_url, autocommit=True) as conn:  # a DBA's setting, equal to the daemon's
        conn.execute(f'ALTER DATABASE "{make_url(fresh_db).database}" SET statement_timeout = \'{outage}s\'')
    with pgbouncer(pg_server_url, ignore_startup_parameters="options") as bouncer:
        pooled = bouncer.url(fresh_db)
        ports = [free_port(), free_port()]
        envs = [procs.daemon_env(pooled, key, metrics_addr=f"127.0.0.1:{p}", database_outage_seconds=outage)
                for p in ports]
        procs.outboxd(envs[0], "migrate", exit_code=0)
        logs = [tmp_path / "a.log", tmp_path / "b.log"]
        daemons = [procs.start_daemon(env, log) for env, log in zip(envs, logs)]
        began = time.monotonic()
        try:
            for port, daemon, log in zip(ports, daemons, logs):
                assert procs.wait_until(lambda: "dropped the connection's startup options"
                                        in procs.readyz(port)[1], 30), (procs.readyz(port), daemon_events(log)[-3:])
                assert "OUTBOX_DATABASE_POOLER=transaction" in procs.readyz(port)[1]
                assert metric(port, 'outbox_database_errors_total{cause="pooler_startup"}') >= 1
            for daemon, log in zip(daemons, logs):
                # Not retried for ever: the daemon exits non-zero once the outage bound has passed.
                daemon.wait(outage + 30)
                assert daemon.returncode not in (None, 0)
                misconfigured = [e for e in daemon_events(log) if e.get("event") == "database.misconfigured"]
                assert len(misconfigured) == 1 and misconfigured[0]["cause"] == "pooler_startup"
                assert "dropped the connection's startup options; set OUTBOX_DATABASE_POOLER=transaction" \
                    in exit_line(log)
            assert time.monotonic() - began < outage + 40
        finally:
            for d in daemons:
                procs.stop(d, signal.SIGKILL)


def test_a_daemon_started_without_the_setting_says_which_one(pg_server_url, fresh_db, tmp_path):
    """PgBouncer refuses the startup options the daemon's engine sends to a direct server: the
    daemon says at once to set OUTBOX_DATABASE_POOLER, on /readyz and in its last line."""
    key, _ = procs.make_key(tmp_path)
    outage = 5
    with pgbouncer(pg_server_url) as bouncer:
        pooled = bouncer.url(fresh_db)
        port = free_port()
        env = procs.daemon_env(pooled, key, metrics_addr=f"127.0.0.1:{port}", database_outage_seconds=outage)
        procs.outboxd(env, "migrate", exit_code=0)
        log = tmp_path / "d.log"
        daemon = procs.start_daemon(env, log)
        try:
            assert procs.wait_until(lambda: "set OUTBOX_DATABASE_POOLER=transaction" in procs.readyz(port)[1], 30), \
                procs.readyz(port)
            assert procs.readyz(port)[0] == 503
            assert daemon.wait(outage + 30) != 0
        finally:
            procs.stop(daemon, signal.SIGKILL)
        assert "refused the connection's startup options; set OUTBOX_DATABASE_POOLER=transaction" in exit_line(log)


async def test_a_listen_connection_through_a_transaction_pooler_is_named_not_silent(pg_server_url, pg_url):
    """LISTEN succeeds through PgBouncer in transaction mode, but the server connection that ran
    it goes back to the pool and its notifications are dropped: the daemon probes with a
    NOTIFY of its own and says so, where it used to poll without a word. Directly, the probe
    is heard and later notifications wake the daemon."""
    import asyncio

    import psycopg
    from structlog.testing import capture_logs

    from outbox.db import libpq_url, make_async_engine
    from outbox.store import CHANNEL
    from supervisor.cycle.cutoff import Cutoff
    from supervisor.cycle.wakeup import PROBE_SECONDS, listen

    async def listened(url: str, seconds: float) -> tuple[list[str], int]:
        woken = []
        engine = make_async_engine(url)
        with capture_logs() as logs:
            task = asyncio.create_task(listen(url, lambda: woken.append(1), cutoff=Cutoff(engine)))
            await asyncio.sleep(seconds)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await engine.dispose()
        return [e["event"] for e in logs], len(woken)

    with pgbouncer(pg_server_url) as bouncer:
        events, _ = await listened(bouncer.url(pg_url), PROBE_SECONDS + 2)
    assert "listen.unheard" in events, events
    woken_at_start = 1

    async def notify_soon() -> None:
        await asyncio.sleep(1.0)
        async with await psycopg.AsyncConnection.connect(libpq_url(pg_url), autocommit=True) as conn:
            await conn.execute(f"NOTIFY {CHANNEL}")

    sender = asyncio.create_task(notify_soon())
    events, woken = await listened(pg_url, 2.0)
    await sender
    assert "listen.unheard" not in events and woken >= woken_at_start + 1, (events, woken)
