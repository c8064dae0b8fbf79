"""supervisor.cycle.outage: failed statements are counted per activity, and their cause is named
from the database's own errors (real PostgreSQL, no stand-ins)."""

from __future__ import annotations

import asyncio
import time

import psycopg
import pytest

from tests.db_proxies import stalling_proxy
from supervisor.cycle.outage import POOLER_HINT, DatabaseUnavailable, OutageGuard, diagnose


def _error_of(pg_url: str, *statements: str) -> psycopg.Error:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        try:
            for statement in statements:
                conn.execute(statement)
        except psycopg.Error as exc:
            return exc
    raise AssertionError("the statements did not fail")


@pytest.mark.parametrize("statements", [
    ("PREPARE _pg3_0 AS SELECT 1", "PREPARE _pg3_0 AS SELECT 2"),  # already exists
    ("EXECUTE _pg3_9",),  # does not exist
])
def test_a_prepared_statement_out_of_place_is_named_and_incurable(pg_url, statements):
    cause = diagnose(_error_of(pg_url, *statements))
    assert cause.label == "prepared_statements" and cause.text == POOLER_HINT and not cause.curable


def test_other_failures_are_curable(pg_url):
    assert diagnose(_error_of(pg_url, "SELECT * FROM no_such_table")).label == "statement"
    assert diagnose(_error_of(pg_url, "SET statement_timeout = 1", "SELECT pg_sleep(1)")).label == "timeout"
    assert diagnose(TimeoutError()).label == "timeout"
    with pytest.raises(psycopg.OperationalError) as refused:
        psycopg.connect("postgresql://postgres@127.0.0.1:1/postgres", connect_timeout=2)
    assert diagnose(refused.value).curable and diagnose(refused.value).label == "connection"


def test_a_connection_that_times_out_or_is_ended_by_the_server_is_named_a_connection_failure(pg_url):
    """psycopg raises these as subclasses of OperationalError named for the condition: a
    connection nobody answers (ConnectionTimeout), a backend terminated or a server shutting
    down (AdminShutdown, 57P01). Both are the database being unreachable, not a statement."""
    with stalling_proxy(pg_url) as (proxy, proxied):
        proxy.stall()
        with pytest.raises(psycopg.OperationalError) as timed_out:
            psycopg.connect(proxied, connect_timeout=2)
    with psycopg.connect(pg_url, autocommit=True) as victim, psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (victim.info.backend_pid,))
        with pytest.raises(psycopg.OperationalError) as ended:
            for _ in range(50):  # until the backend has gone
                victim.execute("SELECT 1")
                time.sleep(0.02)
    for error in (timed_out.value, ended.value):
        assert diagnose(error).label == "connection", (type(error).__name__, diagnose(error))
    assert type(timed_out.value).__name__ == "ConnectionTimeout" and ended.value.sqlstate == "57P01"
    # A statement the server refused is a statement, even where psycopg calls it operational
    # (LockNotAvailable, 55P03, is an OperationalError).
    with psycopg.connect(pg_url) as holder:
        holder.execute("CREATE TABLE IF NOT EXISTS outage_lock_probe ()")
        holder.commit()
        holder.execute("LOCK outage_lock_probe IN ACCESS EXCLUSIVE MODE")
        refused = _error_of(pg_url, "BEGIN", "LOCK outage_lock_probe IN ACCESS SHARE MODE NOWAIT")
        holder.rollback()
        holder.execute("DROP TABLE outage_lock_probe")
    assert isinstance(refused, psycopg.OperationalError) and diagnose(refused).label == "statement"


async def test_claims_that_keep_failing_trip_the_guard_while_other_statements_succeed():
    guard = OutageGuard(0.5)
    with pytest.raises(DatabaseUnavailable, match="claim messages"):
        for _ in range(50):
            guard.ok("maintenance")  # another activity's success does not end the claims' outage
            assert guard.problem() is None or "claim messages" in guard.problem()
            await guard.failed("claim messages", ConnectionError("refused"))
    guard.ok("claim messages")
    assert guard.problem() is None and guard.recovered.is_set()


async def test_failures_after_the_daemon_cut_its_connections_are_neither_counted_nor_an_outage():
    """Once quiet (the daemon cut its own connections at a stop), failures are the cut's own
    doing: no error counted, no outage begun, nothing on ``/readyz``."""
    counted: list[str] = []
    cut = False
    guard = OutageGuard(60, on_error=counted.append, on_outage=lambda: counted.append("outage"),
                        quiet=lambda: cut)
    await guard.failed("maintenance", ConnectionError("refused"))
    assert counted == ["connection", "outage"] and guard.problem() is not None
    guard.ok("maintenance")
    cut = True
    for _ in range(2):
        await guard.failed("claim messages", ConnectionError("closed by the cut"))
    assert counted == ["connection", "outage"] and guard.problem() is None


async def test_an_incurable_failure_stays_on_readyz_and_ends_the_daemon_after_the_deadline(pg_url):
    errors: list[str] = []
    guard = OutageGuard(0.3, on_error=errors.append)
    error = _error_of(pg_url, "EXECUTE _pg3_9")
    waiting = asyncio.create_task(guard.failed("record outcomes", error))
    await asyncio.sleep(0.05)
    guard.ok("record outcomes")  # a later success does not make it safe again
    assert POOLER_HINT in (guard.problem() or "")
    with pytest.raises(DatabaseUnavailable, match="OUTBOX_DATABASE_POOLER=transaction"):
        await waiting
    assert errors == ["prepared_statements"]


def test_a_server_timeout_and_a_poolers_limits_are_named_for_the_setting_to_look_at(pg_url, pg_server_url):
    """A server-side statement_timeout is not the client deadline OUTBOX_DATABASE_STATEMENT_TIMEOUT_SECONDS
    sets; PgBouncer's query_timeout and max_client_conn are the pooler's, not an unreachable database."""
    from sqlalchemy.engine import make_url

    from tests.pgbouncer import pgbouncer

    server = diagnose(_error_of(pg_url, "SET statement_timeout = 1", "SELECT pg_sleep(1)"))
    assert server.label == "timeout" and "statement_timeout of the server" in server.text
    with pgbouncer(pg_server_url, max_client_conn=1, query_timeout=0.5) as bouncer:
        pooled = bouncer.url(make_url(pg_url).render_as_string(hide_password=False))
        with psycopg.connect(pooled, autocommit=True) as first:
            with pytest.raises(psycopg.OperationalError) as refused:
                psycopg.connect(pooled, connect_timeout=5)
            with pytest.raises(psycopg.Error) as killed:
                first.execute("SELECT pg_sleep(3)")
    timed_out, full = diagnose(killed.value), diagnose(refused.value)
    assert (timed_out.label, timed_out.text) == ("timeout", "the connection pooler ended a statement at its query_timeout")
    assert full.label == "connection" and "max_client_conn" in full.text and full.curable


def test_sqlite_failures_are_named_for_what_they_are(tmp_path):
    """SQLite raises every one of these as an OperationalError: a held write lock, a file the
    process may not write and a file it cannot open are named each, not "unreachable"."""
    import os
    import sqlite3
    path = tmp_path / "o.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    waiter = sqlite3.connect(path, timeout=0.05, isolation_level=None)
    with pytest.raises(sqlite3.OperationalError) as locked:
        waiter.execute("BEGIN IMMEDIATE")
    holder.execute("ROLLBACK")
    reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError) as read_only:
        reader.execute("INSERT INTO t VALUES (1)")
    with pytest.raises(sqlite3.OperationalError) as unopened:
        sqlite3.connect(tmp_path / "no" / "such" / "dir.db").execute("SELECT 1")
    causes = {name: diagnose(error.value) for name, error in
              (("locked", locked), ("read_only", read_only), ("unopened", unopened))}
    assert causes["locked"].label == "timeout" and "write lock" in causes["locked"].text
    assert causes["read_only"].label == "statement" and "read-only" in causes["read_only"].text
    assert causes["unopened"].label == "connection" and "directory" in causes["unopened"].text
    assert os.path.exists(path)
