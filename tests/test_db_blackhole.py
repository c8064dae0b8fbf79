"""A database that stops answering without closing anything (a network black hole, a stuck
pooler): the daemon's statements time out, the outage guard counts them, and the daemon
exits non-zero within its bound instead of hanging a claim or a flush for ever; told to
stop meanwhile, it cuts its connections and exits within its shutdown grace.

The black hole is a loopback TCP proxy in this process that, once stalled, still accepts
connections and reads what it is sent (so the client's kernel sees every byte acknowledged)
but forwards nothing either way: neither TCP keepalives nor the TCP user timeout notice it,
only the client's own statement deadline does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psycopg
import pytest
from adcp.reporting.ledger import InMemoryReportingLedgerStore
from adcp.reporting.outbox import (
    DeliveryBinding,
    InMemoryReportingOutbox,
    ReportingEnvelopeCipher,
    ReportingNotificationWorker,
)
from sqlalchemy import text
from sqlalchemy.engine import make_url

from outbox.config import Settings
from outbox.db import connect_options, make_async_engine, make_engine
from outbox.reporting import ReportingHandoff
from supervisor.cycle.cutoff import SETTLE_SECONDS, Cutoff
from supervisor.cycle.daemon import daemon_engine
from supervisor.cycle.schema_watch import SCHEMA_POLL_SECONDS
from supervisor.cycle.pgdirect import DirectConnection, startup_options
from supervisor.observe.health import READY_CACHE_SECONDS, READY_CHECK_SECONDS
from tests import procs
from tests.console_driver import TOKEN, console_env, signed_in
from tests.db_proxies import CommitSwallowingProxy, stalling_proxy
from tests.ledger import check_ledger, daemon_events, enqueue_batch, exit_line, finished, message_key, states
from tests.reporting_world import (ACCOUNT, KEY, LEDGER, SETTINGS, Registry, ledger_body, message_count, prove_all,
                                   register, with_example_handoff)


def test_a_black_holed_database_trips_the_outage_guard_within_its_bound(pg_engine, pg_url, tmp_path):
    key, jwks = procs.make_key(tmp_path)
    timeout, outage = 2, 5
    with procs.receiver(tmp_path, jwks, verifier="library") as (port, arrivals_log), \
            stalling_proxy(pg_url) as (proxy, proxied):
        base = f"http://127.0.0.1:{port}/ok"
        env = procs.daemon_env(proxied, key, database_statement_timeout_seconds=timeout,
                               database_outage_seconds=outage)
        log = tmp_path / "through-proxy.log"
        daemon = procs.start_daemon(env, log)
        try:
            enqueue_batch(pg_engine, [("t1", base, message_key("bh", i)) for i in range(5)])
            assert procs.wait_until(lambda: finished(pg_engine, 5, final=("delivered",)), 40), daemon_events(log)[-3:]
            proxy.stall()
            stalled_at = time.monotonic()
            enqueue_batch(pg_engine, [("t1", base, message_key("bh", i)) for i in range(5, 10)])
            # A claim or flush fails after the statement timeout; reconnecting fails after the
            # connect timeout; past the outage deadline the daemon exits (the driver gives up on
            # its other statements within 10 s). Generous on a busy machine, and finite.
            assert daemon.wait(timeout + 10 + outage + 40) != 0
            elapsed = time.monotonic() - stalled_at
        finally:
            procs.stop(daemon)
        causes = {e.get("cause") for e in daemon_events(log) if e.get("event") == "database.error"}
        assert causes & {"timeout", "connection"}, causes
        assert "database unreachable for" in exit_line(log) or "statement timed out" in exit_line(log)
        print(f"\nblack hole: the daemon exited {elapsed:.1f} s after the database stopped answering "
              f"(statement timeout {timeout} s, outage bound {outage} s)")
        # Nothing was lost: a daemon on a working connection finishes the rest.
        daemon = procs.start_daemon(procs.daemon_env(pg_url, key), tmp_path / "direct.log")
        try:
            assert procs.wait_until(lambda: finished(pg_engine, 10, final=("delivered",)), 60)
        finally:
            procs.stop(daemon)
        summary = check_ledger(pg_engine, [arrivals_log])
        assert summary["delivered"] == 10, summary


def test_an_outage_past_its_bound_names_every_answer_it_could_not_record(pg_engine, pg_url, tmp_path):
    """Requests answered while the database black-holes leave no attempt row: the daemon that
    exits past its outage bound logs each of them (``outcome.unrecorded``) and says how many
    in its last line, so the receivers' answers are on record somewhere; each message is sent
    again once its lease runs out, as after a crash."""
    key, jwks = procs.make_key(tmp_path)
    timeout, outage, total = 2, 5, 6
    with procs.receiver(tmp_path, jwks, verifier="library") as (port, arrivals_log), \
            stalling_proxy(pg_url) as (proxy, proxied):
        env = procs.daemon_env(proxied, key, database_statement_timeout_seconds=timeout,
                               database_outage_seconds=outage)
        log = tmp_path / "through-proxy.log"
        daemon = procs.start_daemon(env, log)
        try:
            enqueue_batch(pg_engine, [("t1", f"http://127.0.0.1:{port}/delay/1500", message_key("bhu", i))
                                      for i in range(total)])
            assert procs.wait_until(lambda: states(pg_engine)["in_flight"] == total, 30), daemon_events(log)[-3:]
            proxy.stall()  # the requests are under way: their answers come while nothing can be recorded
            assert daemon.wait(timeout + 10 + outage + 40) != 0
        finally:
            procs.stop(daemon)
        answered = {a["key"] for a in procs.arrivals(arrivals_log)}
        unrecorded = [e for e in daemon_events(log) if e.get("event") == "outcome.unrecorded"]
        assert answered and {e["idempotency_key"] for e in unrecorded} == answered, (answered, unrecorded)
        assert all(e["outcome"] == "success" and e["http_status"] == 200 for e in unrecorded), unrecorded
        assert f"stopped with {len(unrecorded)} outcome(s) unrecorded" in exit_line(log), exit_line(log)


def test_sigterm_while_the_database_black_holes_ends_before_the_manifests_kill(pg_engine, pg_url, tmp_path):
    """Every setting at its default (statement timeout and shutdown grace 15 s): told to stop
    while the database has stopped answering without closing anything, the daemon exits 1,
    naming what it left unrecorded, before the 30 s the shipped manifests allow before
    SIGKILL, however many of its steps each wait for a statement that will never be answered."""
    key, jwks = procs.make_key(tmp_path)
    total = 400
    with procs.receiver(tmp_path, jwks, verifier="library") as (port, arrivals_log), \
            stalling_proxy(pg_url) as (proxy, proxied):
        env = procs.default_daemon_env(proxied, key)
        log = tmp_path / "through-proxy.log"
        daemon = procs.start_daemon(env, log)
        try:
            enqueue_batch(pg_engine, [(f"t{i % 4}", f"http://127.0.0.1:{port}/delay/300", message_key("bht", i))
                                      for i in range(total)])
            assert procs.wait_until(lambda: states(pg_engine)["delivered"] >= 20, 60), daemon_events(log)[-3:]
            proxy.stall()
            time.sleep(1.0)
        finally:
            rc, took = procs.stop_timed(daemon)
        print(f"\nSIGTERM with the database black-holed: exit {rc} after {took:.1f} s; {exit_line(log)}")
        # The grace (15 s), the recording's floor after it (5 s), the cut work's moment to fail.
        assert rc == 1 and took <= 15 + 5 + 3, f"exit {rc} {took:.1f} s after SIGTERM"
        assert "outcome(s) unrecorded" in exit_line(log), exit_line(log)
        # The cut is said once; the errors it causes itself are neither logged nor counted.
        names = [event.get("event") for event in daemon_events(log)]
        assert names.count("database.cut") == 1, names[-12:]
        after = names[names.index("database.cut"):]
        assert not {"database.error", "listen.reconnecting", "keyring.refresh_failed"} & set(after), after
        # Nothing was lost: a daemon on a working connection finishes the rest once the leases end.
        daemon = procs.start_daemon(procs.daemon_env(pg_url, key), tmp_path / "direct.log")
        try:
            assert procs.wait_until(lambda: finished(pg_engine, total, final=("delivered",)), 180)
        finally:
            procs.stop(daemon)
        assert check_ledger(pg_engine, [arrivals_log])["delivered"] == total


def test_a_transaction_a_black_hole_orphaned_ends_within_the_statement_timeout(pg_engine, pg_url):
    """A black hole that swallows a transaction's next statement leaves the server waiting on a
    client that is gone, holding the rows it locked (a completion's message updates). On the
    daemon's connections, at the defaults, the server ends that transaction after the
    statement timeout (15 s), so those messages are free again before their leases (30 s)
    end; without it they stay locked until the server's TCP keepalives give up, hours later."""
    settings = Settings(database_url=pg_url)
    enqueue_batch(pg_engine, [("t0", "https://buyer.example/hook", message_key("orphan", 0))])
    locked = "SELECT id FROM outbox_messages FOR UPDATE NOWAIT"
    with stalling_proxy(pg_url) as (proxy, proxied):
        orphan = psycopg.connect(proxied, **connect_options(settings), **startup_options(settings))
        orphan.execute("SELECT id FROM outbox_messages FOR UPDATE")  # a transaction holding the row
        proxy.stall()
        freed, took = _until_free(pg_url, locked, settings.database_statement_timeout_seconds + 15)
        orphan.pgconn.finish()  # the client side goes too (its socket to the stalled proxy)
    print(f"\nrow freed {took:.1f} s after the black hole")
    assert freed and took <= settings.database_statement_timeout_seconds + 3, f"{took:.1f} s"


def _until_free(pg_url: str, locked: str, cap: float) -> tuple[bool, float]:
    """Whether the rows ``locked`` (a ``FOR UPDATE NOWAIT``) names, locked now, came free
    within ``cap`` seconds, and after how long."""
    started = time.monotonic()
    with psycopg.connect(pg_url, autocommit=True) as probe:
        with pytest.raises(psycopg.errors.LockNotAvailable):
            probe.execute(locked)
        freed = procs.wait_until(lambda: _lockable(probe, locked), cap)
    return freed, time.monotonic() - started


def _lockable(conn: psycopg.Connection, sql: str) -> bool:
    try:
        with conn.transaction():
            conn.execute(sql)
        return True
    except psycopg.errors.LockNotAvailable:
        return False


async def test_a_cut_fails_statements_waiting_on_a_black_hole_at_once_and_opens_nothing_more(pg_url):
    """Past its deadline the cutoff fails what waits on the engine's connections and on a
    direct connection at once (cancelling instead costs psycopg up to 10 s per connection,
    asking the unreachable server to cancel), and refuses every new connection."""
    with stalling_proxy(pg_url) as (proxy, proxied):
        engine = make_async_engine(proxied)
        direct = DirectConnection.of(engine, Settings(database_url=proxied))
        assert direct is not None
        try:
            async with engine.connect() as conn:  # a pooled connection, open before the stall
                await conn.execute(text("SELECT 1"))
            await direct.execute(text("SELECT 1"))
            proxy.stall()

            async def pooled() -> None:
                async with engine.connect() as conn:
                    await conn.execute(text("SELECT 1"))

            cutoff = Cutoff.of(engine)
            loop = asyncio.get_running_loop()
            started = loop.time()
            results = await asyncio.gather(cutoff.by(started + 0.5, pooled()),
                                           cutoff.by(started + 0.5, direct.execute(text("SELECT 2"))))
            assert results == [False, False] and loop.time() - started < 3, loop.time() - started
            for attempt in (pooled(), direct.execute(text("SELECT 3"))):
                with pytest.raises(Exception, match="waits for the database no longer"):
                    await asyncio.wait_for(attempt, 3)
        finally:
            await direct.aclose()
            await engine.dispose()


async def test_a_cut_fails_connections_still_being_opened_at_once(pg_url):
    """A connection still being opened when the cut comes (its startup swallowed by a black
    hole) fails at once too, by itself: nothing else cancels it, and waiting out its connect
    timeout (the statement timeout, 15 s) held a stop past the manifests' 30 s."""
    with stalling_proxy(pg_url) as (proxy, proxied):
        proxy.stall()
        settings = Settings(database_url=proxied)
        engine = daemon_engine(settings)
        direct = DirectConnection.of(engine, settings)
        assert direct is not None

        async def pooled() -> None:
            async with engine.connect() as conn:
                await conn.execute(text("SELECT 1"))

        try:
            opening = [asyncio.ensure_future(pooled()), asyncio.ensure_future(direct.execute(text("SELECT 1")))]
            await asyncio.sleep(0.5)  # both are waiting for the server's answer to their startup
            assert not any(task.done() for task in opening)
            loop = asyncio.get_running_loop()
            cut_at = loop.time()
            Cutoff.of(engine).cut()
            done, _ = await asyncio.wait(opening, timeout=settings.database_statement_timeout_seconds + 5)
            took = loop.time() - cut_at
            assert len(done) == 2 and took < 1, f"{len(done)} of 2 failed, {took:.1f} s after the cut"
            for task in opening:
                with pytest.raises(Exception, match="waits for the database no longer"):
                    task.result()
        finally:
            await direct.aclose()
            await engine.dispose()


def test_sigterm_while_a_schema_check_goes_unanswered_at_start_stops_the_daemon_at_once(pg_server_url, tmp_path):
    """A daemon waiting for `outboxd migrate` whose next schema check the database leaves
    unanswered: nothing is claimed, so SIGTERM cuts the check's connection and the daemon
    exits 0 at once (cancelling the check instead would take 10 s, psycopg asking the
    unreachable server to cancel it)."""
    name = f"outboxd_unmigrated_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            key, _ = procs.make_key(tmp_path)
            with stalling_proxy(make_url(pg_server_url).set(database=name).render_as_string(
                    hide_password=False)) as (proxy, proxied):
                log = tmp_path / "daemon.log"
                daemon = procs.start_daemon({k: v for k, v in procs.daemon_env(proxied, key).items()
                                             if k != "OUTBOX_SHUTDOWN_GRACE_SECONDS"}, log)
                try:
                    assert procs.wait_until(lambda: "schema.waiting" in log.read_text(), 30), log.read_text()
                    proxy.stall()
                    time.sleep(SCHEMA_POLL_SECONDS + 2)  # the next check has gone out, unanswered
                finally:
                    rc, took = procs.stop_timed(daemon)
        finally:
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    text = log.read_text(errors="replace")
    print(f"\nSIGTERM with a schema check unanswered: exit {rc} after {took:.1f} s")
    assert rc == 0 and took < SETTLE_SECONDS + 4, f"exit {rc} {took:.1f} s after SIGTERM"
    assert "daemon.stopped" in text and "cancellation" not in text and "Traceback" not in text, text[-600:]


def test_the_console_answers_and_stops_while_its_database_never_answers(pg_url, tmp_path):
    """At the defaults (statement timeout and shutdown grace 15 s) a console page whose
    statement the database leaves unanswered gets a 503 saying so within the timeout, and a
    SIGTERM meanwhile stops the console once it has answered: neither waits for ever."""
    port, log = procs.free_port(), tmp_path / "ui.log"
    with stalling_proxy(pg_url) as (proxy, proxied), ThreadPoolExecutor(1) as pool:
        env = {k: v for k, v in console_env(proxied).items() if k != "OUTBOX_SHUTDOWN_GRACE_SECONDS"}
        console = procs.start_ui({**env, "OUTBOX_UI_TOKEN": TOKEN}, port, log)
        try:
            client, _ = signed_in(f"http://127.0.0.1:{port}")
            assert client.get("/messages").status_code == 200  # a pooled connection, answered
            proxy.stall()
            started = time.monotonic()
            page = pool.submit(client.get, "/messages", timeout=60)
            time.sleep(2)  # the page waits on the database
        finally:
            rc, took = procs.stop_timed(console)  # uvicorn ends on the signal it was sent
        answer = page.result()
        waited = time.monotonic() - started
    assert answer.status_code == 503 and "database did not answer" in answer.text, answer.text[-300:]
    assert waited < 15 + 5, waited
    assert rc in (0, -signal.SIGTERM) and took < 15 + 5, (rc, took)


def test_readyz_fails_within_its_check_time_while_the_database_never_answers(pg_url, tmp_path):
    """`/readyz` on a daemon whose database stopped answering: 503 once its check's time has
    passed (the check cuts its connection), not 10 s later for psycopg's cancel request."""
    key, _ = procs.make_key(tmp_path)
    port, log = procs.free_port(), tmp_path / "daemon.log"
    with stalling_proxy(pg_url) as (proxy, proxied):
        daemon = procs.start_daemon(procs.daemon_env(proxied, key, metrics_addr=f"127.0.0.1:{port}"), log)
        try:
            assert procs.wait_until(lambda: "daemon.started" in log.read_text(), 30), log.read_text()[-500:]
            assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10).status_code == 200
            proxy.stall()
            time.sleep(READY_CACHE_SECONDS + 0.5)
            started = time.monotonic()
            answer = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=60)
            waited = time.monotonic() - started
        finally:
            procs.stop_timed(daemon)
    print(f"\n/readyz with the database black-holed: {answer.status_code} after {waited:.1f} s")
    # The check's own cut, or the backstop a second later for a check still connecting.
    assert answer.status_code == 503 and waited < READY_CHECK_SECONDS + 4, (answer.status_code, waited)
    assert "cancellation" not in log.read_text(errors="replace")


def test_a_replay_whose_commit_a_black_hole_swallowed_frees_its_rows_within_the_statement_timeout(pg_engine, pg_url,
                                                                                                   tmp_path):
    """The operator's tools hold transactions too: ``outboxd replay`` locks the messages it
    makes due again, and a black hole that swallows its ``COMMIT`` leaves the server inside
    that transaction, waiting on a client that is gone. Each transaction of the CLI (and the
    console, and ``migrate``) bounds that wait server-side with ``SET LOCAL
    idle_in_transaction_session_timeout``, which works behind a transaction pooler too: at
    the defaults the rows are free 15 s after the black hole, where they stayed locked until
    the server's TCP keepalives gave up, hours later. The CLI is a real process, killed as an
    operator would once it hangs."""
    settings = Settings(database_url=pg_url)
    enqueue_batch(pg_engine, [("t0", "https://buyer.example/hook", message_key("replayed", 0))])
    with pg_engine.begin() as conn:
        message = conn.execute(text("UPDATE outbox_messages SET state = 'dead', dead_reason = 'gone', "
                                    "finished_at = extract(epoch FROM now()) RETURNING id")).scalar_one()
    locked = f"SELECT id FROM outbox_messages WHERE id = {message} FOR UPDATE NOWAIT"
    with stalling_proxy(pg_url, CommitSwallowingProxy) as (proxy, proxied):
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
               "OUTBOX_DATABASE_URL": proxied}
        cli = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "replay", str(message)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert proxy.stalled.wait(30), "the replay never committed"
            freed, took = _until_free(pg_url, locked, settings.database_statement_timeout_seconds + 15)
        finally:
            cli.kill()
            cli.wait()
    print(f"\nreplayed row {'freed' if freed else 'still locked'} {took:.1f} s after the black hole swallowed "
          "the COMMIT")
    assert freed and took <= settings.database_statement_timeout_seconds + 3, f"{took:.1f} s"
    with pg_engine.connect() as conn:  # the transaction ended without its COMMIT: nothing was replayed
        assert conn.execute(text(f"SELECT state FROM outbox_messages WHERE id = {message}")).scalar_one() == "dead"


def test_sigterm_while_the_database_black_holes_with_the_reporting_handoff_ends_before_the_manifests_kill(
        pg_engine, sdk_queues, tmp_path):
    """The same stop with the reporting hand-off running (``OUTBOX_REPORTING_HANDOFF``, the
    SDK's PostgreSQL outbox in the same database, behind the same black hole), defaults
    throughout: its turn waits on the seller's pool, which the daemon's cut cannot reach, and
    cancelling a query there costs psycopg up to 10 s (a cancel request and a wait, 5 s each).
    The daemon cancels the hand-off as the stop begins, so that wait runs within the grace:
    the stop ends before the manifests' 30 s, where cancelling it with the other loops after
    the grace took 31.5 s."""
    key, jwks = procs.make_key(tmp_path)
    total = 40
    with procs.receiver(tmp_path, jwks, verifier="library") as (port, _), \
            stalling_proxy(sdk_queues) as (proxy, proxied):
        metrics_port = procs.free_port()
        env = with_example_handoff(procs.default_daemon_env(
            proxied, key, seller_agent_url=SETTINGS.seller_agent_url, encryption_key=KEY,
            metrics_addr=f"127.0.0.1:{metrics_port}"))
        log = tmp_path / "through-proxy.log"
        daemon = procs.start_daemon(env, log)
        try:
            enqueue_batch(pg_engine, [(f"t{i % 4}", f"http://127.0.0.1:{port}/ok", message_key("bhr", i))
                                      for i in range(total)])
            assert procs.wait_until(lambda: finished(pg_engine, total, final=("delivered",)), 60), \
                daemon_events(log)[-3:]
            # The hand-off has run a turn (it sets the backlog gauge): the SDK's import is done.
            assert procs.wait_until(lambda: "outbox_reporting_handoff_backlog{" in httpx.get(
                f"http://127.0.0.1:{metrics_port}/metrics").text, 120)
            proxy.stall()
            time.sleep(2.0)  # the next turn (a poll later) waits on the black hole
        finally:
            rc, took = procs.stop_timed(daemon)
        print(f"\nSIGTERM with the database black-holed and the hand-off waiting on it: exit {rc} after {took:.1f} s")
        assert rc == 0 and took < 30, f"exit {rc} {took:.1f} s after SIGTERM; {exit_line(log)}"


def test_a_handoff_whose_commit_a_black_hole_swallowed_holds_its_key_only_for_the_statement_timeout(pg_engine,
                                                                                                    pg_url):
    """The reporting hand-off stores each SDK delivery as an outboxd message in a transaction
    of the seller's engine. A black hole that swallows its ``COMMIT`` leaves the server holding
    the new row, its (tenant, key) taken: the same delivery handed off again (its SDK lease
    lapsed) waited on it until the server's TCP keepalives gave up, hours later. The hand-off
    bounds its own transaction, whatever engine a factory gives it, so at the defaults the
    next hand-off stores the message about 15 s after the black hole."""
    bound = SETTINGS.database_statement_timeout_seconds  # the default, 15 s: what the hand-off bounds itself by
    register(pg_engine, "sub-a", "buyer-a", "http://127.0.0.1:9/a")
    prove_all(pg_engine)
    body = ledger_body("sub-a")
    key = json.loads(body)["idempotency_key"]
    binding = DeliveryBinding(
        account_id=ACCOUNT, delivery_id="dlv_1", subscriber_id="sub-a", principal_id="buyer-a",
        notification_id="evt_1", notification_type=LEDGER, emission_generation=1, idempotency_key=key,
        destination_sha256="0" * 64, subscription_fingerprint="f", signing_scope_id=None, cause_kind="revision",
        cause_id="rev_1", cause_generation=1, consumer_namespace="buyer-a", auth_mode="none",
        body_sha256=hashlib.sha256(body).hexdigest(), envelope_version=1, key_version="k1")
    worker = ReportingNotificationWorker(outbox=InMemoryReportingOutbox(InMemoryReportingLedgerStore(notifications=True)),
                                         subscriptions=Registry(), cipher=ReportingEnvelopeCipher(os.urandom(32)))

    def handoff(engine: Any) -> ReportingHandoff:
        return ReportingHandoff(worker=worker, engine=engine, tenant_id="t1", settings=SETTINGS)

    # The proxy closes first: what still waits on it fails, and the pool can end.
    with ThreadPoolExecutor(2) as pool, stalling_proxy(pg_url, CommitSwallowingProxy) as (proxy, proxied):
        cut_engine = make_engine(proxied)
        pool.submit(handoff(cut_engine).commit_message, binding, body)  # its COMMIT goes into the black hole
        assert proxy.stalled.wait(30), "the hand-off never committed"
        cut = time.monotonic()
        again = pool.submit(handoff(pg_engine).commit_message, binding, body)  # the delivery handed off again
        try:
            stored = again.result(timeout=bound + 15)
        except TimeoutError:
            stored = None
        took = time.monotonic() - cut
    cut_engine.dispose()
    print(f"\nthe delivery handed off again {'stored' if stored else 'still waiting'} {took:.1f} s after the "
          "black hole swallowed the first hand-off's COMMIT")
    assert stored and took <= bound + 3, f"{took:.1f} s"
    assert message_count(pg_engine) == 1
