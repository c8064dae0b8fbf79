"""supervisor.cycle.pgdirect: the hot statements on the driver's own connection read and write
exactly what they do through SQLAlchemy, and the connection comes back after it is lost."""

from __future__ import annotations

import dataclasses

import pytest
from sqlalchemy import select, text

from outbox import leases, store
from outbox.config import Settings
from outbox.db import make_async_engine
from outbox.schema import attempts, messages
from outbox.leases import Completion
from supervisor.cycle.pgdirect import DirectConnection
from tests.db_proxies import TurnCountingProxy, stalling_proxy
from tests.ledger import enqueue_batch, message_key

CLAIM = dict(limit=50, lease_seconds=30.0, horizon_seconds=86_400, endpoint_concurrency=16)


def _same(claimed: list[leases.Claimed]) -> list[leases.Claimed]:
    """Claimed rows without what differs between two claims by design (token, clock)."""
    return [dataclasses.replace(c, lease_token="", claimed_at=0.0, retry_until=0.0, claim_sent=0.0) for c in claimed]


async def test_claim_complete_and_attempt_rows_match_sqlalchemy(pg_engine, pg_url) -> None:
    rows = [(f"t{i % 3}", f"https://buyer-{i % 2}.example/hook?x={i}", message_key("direct", i)) for i in range(12)]
    enqueue_batch(pg_engine, rows)
    engine = make_async_engine(pg_url)
    direct = DirectConnection.of(engine, Settings())
    assert direct is not None
    try:
        async with engine.begin() as conn:
            via_sqlalchemy = await store.claim(conn, daemon_id="a", **CLAIM)
        with pg_engine.begin() as conn:  # hand them back untouched, to claim them again
            conn.execute(text("UPDATE outbox_messages SET state = 'pending', attempts = 0, leased_by = NULL,"
                              " lease_token = NULL, lease_expires_at = NULL"))
        via_driver = await direct.execute(text("SELECT 1 AS one"))  # a first statement opens the connection
        assert via_driver.scalar_one() == 1
        claimed = await store.claim(direct, daemon_id="a", **CLAIM)
        assert _same(claimed) == _same(via_sqlalchemy) and len(claimed) == 12

        async with direct.transaction() as conn:
            now = await store.db_now(conn)
            applied = await store.complete(conn, [Completion(c.id, c.lease_token, "delivered") for c in claimed])
            await store.insert_attempts(conn, [{"message_id": c.id, "tenant_id": c.tenant_id, "url": c.url,
                                                "attempt_number": 1, "outcome": "success", "http_status": 200,
                                                "error": None, "response_time_ms": 3, "will_retry": False,
                                                "next_retry_at": None, "payload_size": len(c.body),
                                                "sequence_number": None, "idempotency_key": c.idempotency_key,
                                                "notification_type": None, "trigger": "scheduled",
                                                "daemon_id": "a", "occurred_at": now} for c in claimed])
        assert applied == {c.id for c in claimed}
        with pg_engine.connect() as conn:
            assert set(conn.execute(select(messages.c.state)).scalars()) == {"delivered"}
            assert conn.execute(select(attempts.c.message_id).order_by(attempts.c.message_id)).scalars().all() == \
                sorted(c.id for c in claimed)
    finally:
        await direct.aclose()
        await engine.dispose()


async def test_a_failed_transaction_writes_nothing_and_a_lost_connection_is_reopened(pg_engine, pg_url) -> None:
    enqueue_batch(pg_engine, [("t", "https://buyer.example/hook", message_key("lost", 0))])
    engine = make_async_engine(pg_url)
    direct = DirectConnection.of(engine, Settings())
    assert direct is not None
    try:
        claimed = await store.claim(direct, daemon_id="a", **CLAIM)
        with pytest.raises(RuntimeError):
            async with direct.transaction() as conn:
                await store.complete(conn, [Completion(claimed[0].id, claimed[0].lease_token, "delivered")])
                raise RuntimeError("the flush fails half-way")
        pid = (await direct.execute(text("SELECT pg_backend_pid() AS pid"))).scalar_one()
        with pg_engine.connect() as conn:
            assert conn.execute(select(messages.c.state)).scalar_one() == "in_flight", "rolled back"
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(Exception):
            await direct.execute(text("SELECT 1 AS one"))  # the statement that finds it gone fails
        assert (await direct.execute(text("SELECT pg_backend_pid() AS pid"))).scalar_one() != pid
    finally:
        await direct.aclose()
        await engine.dispose()


async def test_a_pipelined_pair_is_one_transaction_and_a_failed_first_statement_leaves_both_undone(
        pg_engine, pg_url) -> None:
    """``execute_after`` (the claim's fold, then the claim) commits both statements together or
    neither, and the connection serves the next statement either way."""
    with pg_engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS direct_pair (tx text)"))
        conn.execute(text("DELETE FROM direct_pair"))
    engine = make_async_engine(pg_url)
    direct = DirectConnection.of(engine, Settings())
    assert direct is not None
    try:
        first = text("INSERT INTO direct_pair VALUES (pg_current_xact_id()::text)")
        second = text("SELECT pg_current_xact_id()::text AS tx, CAST(:n AS int) + 1 AS n")
        result = await direct.execute_after(first, second, {"n": 41})
        (row,) = list(result)
        assert row.n == 42
        with pg_engine.connect() as conn:
            assert conn.execute(text("SELECT tx FROM direct_pair")).scalars().all() == [row.tx]
        with pytest.raises(Exception, match="division by zero"):
            await direct.execute_after(text("INSERT INTO direct_pair VALUES (CAST(1 / 0 AS text))"), first)
        with pytest.raises(Exception, match="division by zero"):  # the second fails: the first is undone
            await direct.execute_after(first, text("SELECT 1 / 0 AS never"))
        assert (await direct.execute(text("SELECT count(*) AS n FROM direct_pair"))).scalar_one() == 1
    finally:
        await direct.aclose()
        await engine.dispose()
        with pg_engine.begin() as conn:
            conn.execute(text("DROP TABLE direct_pair"))


async def test_a_transaction_waits_only_for_the_rows_it_reads(pg_engine, pg_url) -> None:
    """A flush's shape (the clock, the completion's UPDATE ... RETURNING, two INSERTs whose
    results nobody reads, the COMMIT) takes three round trips, not one per statement; an
    INSERT that fails fails the COMMIT and undoes the whole transaction; and a failure in the
    middle of a pipeline leaves the connection fit for the next transactions."""
    with pg_engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS direct_flush (n int)"))
        conn.execute(text("DELETE FROM direct_flush"))
        conn.execute(text("INSERT INTO direct_flush VALUES (0)"))
    now = text("SELECT now() AS now")
    bump = text("UPDATE direct_flush SET n = n + 1 WHERE n >= 0 RETURNING n")
    add = text("INSERT INTO direct_flush SELECT CAST(:n AS int) / CAST(:d AS int)")
    count = text("SELECT count(*) AS rows, max(n) AS top FROM direct_flush")

    async def flush(conn: DirectConnection, value: int) -> None:
        await conn.execute(now)
        await conn.execute(bump)
        await conn.execute(add, {"n": -value, "d": 1})
        await conn.execute(add, {"n": value, "d": value})  # the value 0 makes the failing flush

    with stalling_proxy(pg_url, TurnCountingProxy) as (proxy, url):
        engine = make_async_engine(url)
        direct = DirectConnection.of(engine, Settings())
        assert direct is not None and isinstance(proxy, TurnCountingProxy)
        try:
            assert tuple((await direct.execute(count)).one()) == (1, 0)  # connected
            for value in range(1, 8):  # past psycopg's threshold for preparing a statement
                proxy.turns = 0
                async with direct.transaction() as conn:
                    await flush(conn, value)
                assert proxy.turns == 3, f"{proxy.turns} round trips for a flush"
            assert tuple((await direct.execute(count)).one()) == (15, 7)
            with pytest.raises(Exception, match="division by zero"):
                async with direct.transaction() as conn:
                    await flush(conn, 0)
            with pytest.raises(Exception, match="division by zero"):  # a failed INSERT, then rows read
                async with direct.transaction() as conn:
                    await conn.execute(add, {"n": 1, "d": 1})
                    await conn.execute(text("SELECT CAST(1 / 0 AS int) AS never"))
                    await conn.execute(bump)
            for value in range(1, 3):
                async with direct.transaction() as conn:
                    await flush(conn, value)
            assert tuple((await direct.execute(count)).one()) == (19, 9), "both failures undone whole"
        finally:
            await direct.aclose()
            await engine.dispose()
            with pg_engine.begin() as conn:
                conn.execute(text("DROP TABLE direct_flush"))


def test_sqlite_keeps_sqlalchemy(sqlite_url) -> None:
    assert DirectConnection.of(make_async_engine(sqlite_url), Settings()) is None


async def test_attempt_rows_read_back_as_written_on_both_databases(engine) -> None:
    """A batch of attempt rows (PostgreSQL: one INSERT from a JSON array) reads back value for
    value: extreme integers, exact floats, booleans, NULLs and text JSON must escape."""
    texts = ['quote " backslash \\ slash /', "line\nbreak\ttab", "ünïcödé ✓ \u2028 😀", "{\"not\": [json]}"]
    rows = [{"message_id": 2**62 + i, "tenant_id": texts[i % 4], "url": "https://buyer.example/hook",
             "attempt_number": i + 1, "outcome": ("success", "http_error", "timeout")[i % 3],
             "http_status": None if i % 3 == 2 else 200 + i, "error": texts[(i + 1) % 4] if i % 2 else None,
             "response_time_ms": 2**31 - 1 - i, "will_retry": bool(i % 2),
             "next_retry_at": 1_764_000_000.123456 + i / 7 if i % 2 else None, "payload_size": i * 1000,
             "sequence_number": 2**63 - 1 - i if i % 2 else None, "idempotency_key": f"whk_{i:036d}",
             "notification_type": "scheduled" if i % 2 else None, "trigger": "scheduled", "daemon_id": "host:1:ab",
             "occurred_at": 1_764_000_000.987654321 + i, "trace_id": None, "span_id": None,
             "response_excerpt": texts[i % 4]} for i in range(8)]
    async_engine = make_async_engine(engine.url.render_as_string(hide_password=False))
    try:
        async with async_engine.begin() as conn:
            await store.insert_attempts(conn, rows)
    finally:
        await async_engine.dispose()
    columns = [attempts.c[name] for name in rows[0]]
    with engine.connect() as conn:
        stored = [dict(r._mapping) for r in conn.execute(select(*columns).order_by(attempts.c.message_id))]
    assert stored == rows
