"""The claim's due tables stay the size of what is live, whatever burst went through them.

Every claim's fold deletes what ``outbox_due_arrivals`` holds (up to ``FOLD_LIMIT``),
reading it from the start, dead rows included: after a burst it read every page the burst's arrivals took until a vacuum
came, and autovacuum may come a minute later or never (it is off on some servers, this
one's included). The daemon's maintenance vacuums the due tables once they hold dead rows
(:func:`supervisor.cycle.maintenance.vacuum_due_tables`). Real PostgreSQL, real statistics.
"""

from __future__ import annotations

import asyncio
import time

from sqlalchemy import text

from outbox.db import make_async_engine
from outbox.store import _STATEMENTS
from supervisor.cycle.maintenance import DUE_TRUNCATE_BYTES, vacuum_due_tables

BURST = 3_000
ORIGIN = "https://buyer.example.com"


def _burst(engine, count: int) -> None:
    """``count`` due messages committed at once (plain SQL, as any producer may), their
    arrivals folded in by the daemon's own statement."""
    with engine.begin() as conn:
        conn.execute(text("""
            INSERT INTO outbox_messages (tenant_id, url, idempotency_key, body, task_id, task_type, task_status)
            SELECT 't' || (g % 10), :url, 'whk_burst_' || g, convert_to('{"idempotency_key":"whk_burst_' || g || '"}',
                   'UTF8'), 'task_' || g, 'create_media_buy', 'completed'
            FROM generate_series(1, :n) AS g
        """), {"url": f"{ORIGIN}/hook", "n": count})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(_STATEMENTS[True].gather_due)


def _dead_rows(engine, table: str) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = to_regclass(:t)"),
                            {"t": table}).scalar_one()


def _reported(engine, table: str, at_least: int) -> None:
    """Wait until the statistics show the fold's dead rows (a backend reports them when its
    transaction ends, at most once a second)."""
    deadline = time.monotonic() + 15
    while _dead_rows(engine, table) < at_least:
        assert time.monotonic() < deadline, f"{table}: the statistics never showed {at_least} dead rows"
        time.sleep(0.2)


def _size(engine, table: str) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT pg_relation_size(to_regclass(:t))"), {"t": table}).scalar_one()


def _fold_reads(engine) -> int:
    """Shared buffers the fold reads when there is nothing to fold."""
    with engine.connect() as conn, conn.begin() as txn:
        plan = conn.execute(text("EXPLAIN (ANALYZE, BUFFERS) " + _STATEMENTS[True].gather_due.text)).scalars().all()
        txn.rollback()
    return max(int(part.split("=")[1]) for line in plan for part in line.split() if part.startswith("hit="))


def _vacuum(pg_url: str, **kwargs) -> list[str]:
    async def run() -> list[str]:
        engine = make_async_engine(pg_url)
        try:
            return await vacuum_due_tables(engine, **kwargs)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def test_a_burst_leaves_the_fold_reading_its_pages_until_the_daemon_vacuums_them_away(pg_engine, pg_url) -> None:
    """3,000 arrivals folded in: the next fold, with nothing to fold, still reads the pages
    they took. The upkeep vacuums the arrivals and, the table being over its size, gives the
    pages back; the fold then reads a few buffers, and the upkeep has nothing more to do
    there. (The other due tables may hold what earlier tests' clean-up left dead: they are
    not judged here.)"""
    _burst(pg_engine, BURST)
    _reported(pg_engine, "outbox_due_arrivals", BURST)
    before, size = _fold_reads(pg_engine), _size(pg_engine, "outbox_due_arrivals")
    assert before >= 20, f"the fold read {before} buffers after folding {BURST} arrivals"

    assert "outbox_due_arrivals" in _vacuum(pg_url, truncate_bytes=size - 1)
    after = _fold_reads(pg_engine)
    assert after <= 5, f"the fold still reads {after} buffers once the arrivals were vacuumed ({before} before)"
    assert _size(pg_engine, "outbox_due_arrivals") == 0
    assert "outbox_due_arrivals" not in _vacuum(pg_url)


def test_below_its_size_a_vacuumed_table_keeps_its_pages_for_the_next_arrivals(pg_engine, pg_url) -> None:
    """Steady traffic's vacuums never shorten a table (that would take the lock producers'
    inserts wait on): the dead arrivals go, and the next burst reuses their pages instead of
    growing the table."""
    _burst(pg_engine, BURST)
    _reported(pg_engine, "outbox_due_arrivals", BURST)
    size = _size(pg_engine, "outbox_due_arrivals")
    assert 0 < size < DUE_TRUNCATE_BYTES
    assert "outbox_due_arrivals" in _vacuum(pg_url)
    assert _size(pg_engine, "outbox_due_arrivals") == size, "a vacuum below the size shortened the table"
    with pg_engine.begin() as conn:
        conn.execute(text("DELETE FROM outbox_messages"))
    _burst(pg_engine, BURST)
    assert _size(pg_engine, "outbox_due_arrivals") == size, "the next arrivals did not reuse the vacuumed pages"


def test_a_due_table_is_vacuumed_from_the_threshold_on_and_left_to_autovacuum_below_it(pg_engine, pg_url) -> None:
    """Below the threshold nothing is vacuumed: a vacuum a tick for every handful of
    messages would cost more than the reads it saves. (The count is read back, so dead rows
    earlier tests' clean-up left in the table count too.)"""
    _burst(pg_engine, 20)
    _reported(pg_engine, "outbox_due_arrivals", 20)
    dead = _dead_rows(pg_engine, "outbox_due_arrivals")
    assert "outbox_due_arrivals" not in _vacuum(pg_url, dead_rows=dead + 1)
    assert "outbox_due_arrivals" in _vacuum(pg_url, dead_rows=dead)


def _vacuums(engine, table: str) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = to_regclass(:t)"),
                            {"t": table}).scalar_one()


def test_the_daemons_maintenance_vacuums_a_burst_away_with_its_defaults(pg_engine, pg_url) -> None:
    """The upkeep as the daemon runs it (its maintenance loop, default threshold and tick):
    a burst's dead arrivals are vacuumed within a few ticks. (Below 1 MiB the table keeps its
    pages for the next arrivals, as the test above shows, so the fold's reads stay.)"""
    from outbox.db import make_async_engine as engine_for
    from supervisor.cycle.maintenance import Maintenance
    from supervisor.cycle.outage import OutageGuard
    from supervisor.observe.metrics import Metrics

    _burst(pg_engine, BURST)
    _reported(pg_engine, "outbox_due_arrivals", BURST)
    vacuums = _vacuums(pg_engine, "outbox_due_arrivals")

    async def run() -> None:
        engine = engine_for(pg_url)
        task = asyncio.create_task(Maintenance(engine, daemon_id="d", metrics=Metrics(), outage=OutageGuard(5),
                                               horizon_seconds=86_400).run())
        try:
            deadline = time.monotonic() + 30  # a tick every 2 s; a loaded machine is slow
            while _vacuums(pg_engine, "outbox_due_arrivals") == vacuums and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await engine.dispose()

    asyncio.run(run())
    assert _vacuums(pg_engine, "outbox_due_arrivals") > vacuums, "the maintenance never vacuumed the arrivals"
    assert _dead_rows(pg_engine, "outbox_due_arrivals") < BURST, "the vacuum left the burst's arrivals"


def test_a_daemon_started_on_a_backlog_of_arrivals_delivers_within_its_statement_deadline(pg_engine, pg_url,
                                                                                         tmp_path) -> None:
    """Arrivals pile up while no daemon of this release runs (hours without one, or daemons
    of the release before the due tables, which deliver without folding). A claim folds at
    most ``FOLD_LIMIT`` of them, so each claim stays within the server-side statement
    timeout (``OUTBOX_DATABASE_OUTAGE_SECONDS``) and the daemon delivers what is behind the
    pile. Folded in one statement, a pile takes as long as it is big (10,000,000 arrivals:
    14.8 s on a 2-vCPU box, so some 40,000,000 pass the default 60 s): the server cancels it,
    the claim rolls back, and so does every claim after, until the outage bound ends the
    daemon, which restarts into the same pile. Here 1,500,000 arrivals of another origin's
    endpoints and a 2 s timeout (the setting is not what is tested; it keeps the pile small)."""
    from tests import procs
    from tests.ledger import daemon_events, enqueue_batch, finished, message_key

    key, jwks = procs.make_key(tmp_path)
    total = 40
    with procs.receiver(tmp_path, jwks, verifier="library") as (port, _):
        url = f"http://127.0.0.1:{port}/hook"
        with pg_engine.begin() as conn:
            conn.execute(text("""
                INSERT INTO outbox_due_arrivals (tenant_id, origin, due)
                SELECT 'gone' || (g % 1000), 'https://gone.example', extract(epoch FROM now())
                FROM generate_series(1, :n) AS g
            """), {"n": 1_500_000})
        enqueue_batch(pg_engine, [(f"t{i % 4}", url, message_key("pile", i)) for i in range(total)])
        log = tmp_path / "daemon.log"
        daemon = procs.start_daemon(procs.daemon_env(pg_url, key, database_statement_timeout_seconds=1,
                                                      database_outage_seconds=2), log)
        try:
            started = time.monotonic()
            delivered = procs.wait_until(lambda: finished(pg_engine, total, final=("delivered",)), 60)
            took = time.monotonic() - started
            assert delivered, daemon_events(log)[-3:]
            # An idle daemon claims again at once while a pile is left (5.9-7.7 s here); waiting
            # for the poll, a wake-up or maintenance before each of the pile's 30 folds took 20.2 s.
            assert took < 15, f"{took:.1f} s"
            assert procs.wait_until(lambda: _count(pg_engine, "outbox_due_arrivals") == 0, 30)
        finally:
            procs.stop(daemon)
    print(f"\n{total} delivered {took:.1f} s after the start, behind 1,500,000 arrivals")


def _count(engine, table: str) -> int:
    with engine.connect() as conn:
        return conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()


def test_messages_behind_endpoints_with_nothing_pending_are_delivered_without_a_poll_per_claim(pg_engine, pg_url,
                                                                                              tmp_path) -> None:
    """An endpoint's due row can outlive its work: a cancel job or the horizon sweep ends
    its messages without a claim, and a daemon of the release before the due tables delivers
    them without writing the row back. A claim visits an origin's endpoints longest-waiting
    first, as many as the origin has free slots (16 at the defaults), and drops those with
    nothing pending; a claim that dropped some claims again at once, so live messages behind
    2,000 such rows on their own origin go within a second or two, where a poll (1 s) after
    each claim of 16 took two minutes. Defaults throughout."""
    from outbox.urls import endpoint_origin
    from tests import procs
    from tests.ledger import daemon_events, enqueue_batch, finished, message_key

    key, jwks = procs.make_key(tmp_path)
    total, stale = 40, 2_000
    with procs.receiver(tmp_path, jwks, verifier="library") as (port, _):
        url = f"http://127.0.0.1:{port}/hook"
        with pg_engine.begin() as conn:  # due a minute before the live messages: visited first
            conn.execute(text("""
                INSERT INTO outbox_due_arrivals (tenant_id, origin, due)
                SELECT 'gone' || g, :origin, extract(epoch FROM now()) - 60 FROM generate_series(1, :n) AS g
            """), {"n": stale, "origin": endpoint_origin(url)})
        log = tmp_path / "daemon.log"
        daemon = procs.start_daemon(procs.default_daemon_env(pg_url, key), log)
        try:
            assert procs.wait_until(lambda: _count(pg_engine, "outbox_due_arrivals") == 0, 30)
            started = time.monotonic()
            enqueue_batch(pg_engine, [(f"t{i % 4}", url, message_key("behind", i)) for i in range(total)])
            delivered = procs.wait_until(lambda: finished(pg_engine, total, final=("delivered",)), 60)
            took = time.monotonic() - started
            assert delivered, daemon_events(log)[-3:]
            assert took < 15, f"{took:.1f} s"
            assert procs.wait_until(lambda: _count(pg_engine, "outbox_due_endpoints") == 0, 10), \
                "rows with nothing pending were left"
        finally:
            procs.stop(daemon)
    print(f"\n{total} delivered {took:.1f} s after their enqueue, behind {stale:,} endpoints with nothing pending")


def test_the_daemons_own_engine_vacuums_on_its_first_connection(pg_engine, pg_url) -> None:
    """Each new connection of the daemon's engine is checked for its startup options first;
    the check must leave no transaction open, or the vacuum on that connection (which needs
    autocommit) fails until the pool hands out another."""
    from outbox.config import Settings
    from supervisor.cycle.daemon import daemon_engine

    _burst(pg_engine, 20)
    engine = daemon_engine(Settings(database_url=pg_url))
    try:
        assert "outbox_due_arrivals" in asyncio.run(vacuum_due_tables(engine, dead_rows=0))
    finally:
        asyncio.run(engine.dispose())
