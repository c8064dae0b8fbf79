"""The PostgreSQL claim reads the endpoints with due work, not every endpoint with a backlog.

Its work (shared buffers, which do not depend on the machine's speed) stays flat from ten
to thousands of backlogged endpoints; the tables it walks never hide a due message, whatever
mix of enqueues, claims, retries, deliveries, replays and breakers came before (checked
against the messages themselves); and work that arrives for an endpoint in backoff or
behind a breaker that closes is claimed at once.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
from sqlalchemy import text

from outbox import breaker_rows, leases, store
from outbox.db import make_async_engine
from outbox.store import _STATEMENTS
from supervisor.cycle.breaker import closed_row

ORIGIN = "https://buyer-0.example.com"  # what _insert gives every message with one origin
BUDGET = 16  # the claimer's per-origin lease budget with the default endpoint concurrency
_INSERT = text("""
    INSERT INTO outbox_messages (tenant_id, url, idempotency_key, body, next_attempt_at)
    SELECT 't' || (g % :endpoints), 'https://buyer-' || (g % :endpoints % :origins) || '.example.com/hook',
           :run || g, convert_to(repeat('x', 600), 'UTF8'), extract(epoch from now()) + :offset
    FROM generate_series(1, :total) AS g
""")


def _insert(conn: Any, *, endpoints: int, per: int = 1, origins: int = 1, offset: float = -1.0) -> None:
    conn.execute(_INSERT, {"endpoints": endpoints, "origins": origins, "total": endpoints * per,
                           "offset": offset, "run": f"whk_{uuid.uuid4().hex}_"})


def _claim_buffers(pg_engine: Any) -> int:
    """Shared buffers of one claim (limit 50, the default budget), the median of five, each
    in a transaction rolled back."""
    statements = _STATEMENTS[True]
    with pg_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(statements.gather_due)
        conn.execute(text("VACUUM ANALYZE"))
    claim = statements.claim
    explain = text("EXPLAIN (ANALYZE, BUFFERS) " + claim.text).bindparams(*claim._bindparams.values())
    hits = []
    for _ in range(5):
        with pg_engine.connect() as conn, conn.begin() as txn:
            plan = "\n".join(row[0] for row in conn.execute(explain, {
                "limit": 50, "lease": 30.0, "horizon": 86_400, "daemon": "d", "token": "t", "cap": BUDGET,
                "held": "{}"}))
            txn.rollback()
        hits.append(int(re.search(r"shared hit=(\d+)", plan).group(1)))
    return sorted(hits)[2]


@pytest.mark.parametrize(("origins", "few"), [(1, 10), (0, 100)], ids=["tenants-of-one-origin", "one-origin-each"])
def test_claim_work_does_not_grow_with_backlogged_endpoints(pg_engine, origins, few):
    """A few backlogged endpoints vs three thousand, five due messages each: each endpoint
    beyond the few adds at most a quarter of a buffer to the claim (a claim that walked every
    endpoint with pending work read six and more for each: 63,000 for 10,000 endpoints).
    Measured: 0.06 (tenants of one origin) and 0.14 (an origin each). A ratio of the two
    counts sat at 1.47 against a bound of 1.5, and the few's count moved by 11 buffers with
    what the database had held before, so the growth per endpoint is what is judged here; the
    bench judges the ratio at 10,000 endpoints (docs/performance.md, "Many backlogged endpoints").

    Tenants of one origin: ten endpoints fill the origin's budget as three thousand do. An
    origin each: a batch of fifty spans fifty endpoints from a hundred on, so that is the
    like-for-like comparison (ten endpoints give five rows each, from fewer endpoints)."""
    cost = {}
    for endpoints in (few, 3_000):
        with pg_engine.begin() as conn:
            conn.execute(text("TRUNCATE outbox_messages, outbox_due_origins, outbox_due_endpoints, "
                              "outbox_due_arrivals, outbox_breakers"))
            _insert(conn, endpoints=endpoints, per=5, origins=origins or endpoints)
        cost[endpoints] = _claim_buffers(pg_engine)
    assert (cost[3_000] - cost[few]) / (3_000 - few) <= 0.25, cost


async def _claim(engine: Any, *, limit: int = 50, cap: int = BUDGET, daemon: str = "d1",
                 held: Sequence[leases.Claimed] = ()) -> leases.ClaimedBatch:
    """A claim by ``daemon``, which holds the leases ``held``."""
    async with engine.begin() as conn:
        return await store.claim(conn, limit=limit, lease_seconds=30, horizon_seconds=86_400, daemon_id=daemon,
                                 endpoint_concurrency=cap, held=Counter(m.origin or "" for m in held))


async def _complete(engine: Any, claimed: Sequence[leases.Claimed], state: str, next_in: float = 0.0) -> None:
    async with engine.begin() as conn:
        now = await store.db_now(conn)
        await store.complete(conn, [leases.Completion(c.id, c.lease_token, state, next_attempt_at=now + next_in)
                                    for c in claimed])


async def _breaker(engine: Any, tenant: str, open_for: float | None) -> None:
    """Open the endpoint's breaker for ``open_for`` seconds, or reset it (``None``)."""
    async with engine.begin() as conn:
        if open_for is None:
            await conn.execute(text("DELETE FROM outbox_breakers WHERE tenant_id = :t"), {"t": tenant})
            return
        now = await store.db_now(conn)
        await breaker_rows.save_breakers(conn, [{**closed_row(tenant, ORIGIN), "state": "open", "trips": 1,
                                                 "open_until": now + open_for, "updated_at": now}])


async def test_new_work_behind_a_backoff_or_a_closed_breaker_goes_at_once(pg_engine):
    engine = make_async_engine(pg_engine.url.render_as_string(hide_password=False))
    try:
        with pg_engine.begin() as conn:
            _insert(conn, endpoints=3)  # t0, t1, t2: one due message each
        first = await _claim(engine)
        assert len(first) == 3
        await _complete(engine, first, "pending", next_in=60)  # all three back off for a minute
        assert await _claim(engine) == []
        with pg_engine.begin() as conn:  # new work for t0 while its older message waits out its backoff
            conn.execute(text("INSERT INTO outbox_messages (tenant_id, url, idempotency_key, body) "
                              "VALUES ('t0', :u, 'whk_new_t0', 'x')"), {"u": ORIGIN + "/hook"})
        assert [m.idempotency_key for m in await _claim(engine)] == ["whk_new_t0"]
        await _breaker(engine, "t1", open_for=60)
        with pg_engine.begin() as conn:
            conn.execute(text("UPDATE outbox_messages SET next_attempt_at = next_attempt_at - 120 "
                              "WHERE tenant_id IN ('t1', 't2') AND state = 'pending'"))
        assert [m.tenant_id for m in await _claim(engine)] == ["t2"], "t1's breaker is open"
        assert await _claim(engine) == []
        await _breaker(engine, "t1", open_for=None)  # the operator resets it
        assert [m.tenant_id for m in await _claim(engine)] == ["t1"]
    finally:
        await engine.dispose()


async def test_a_claim_that_another_holds_rows_of_comes_back_contended(pg_engine):
    """Two daemons' claims read the same heads: the one that finds them locked leases nothing
    and says so, and its next claim takes what is left once the other has committed."""
    engine = make_async_engine(pg_engine.url.render_as_string(hide_password=False))
    try:
        with pg_engine.begin() as conn:
            _insert(conn, endpoints=1, per=20)
        with pg_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(_STATEMENTS[True].gather_due)  # nothing left to fold: no claim waits on it
        async with engine.begin() as first:
            held = await store.claim(first, limit=50, lease_seconds=30, horizon_seconds=86_400, daemon_id="d1",
                                     endpoint_concurrency=BUDGET)
            assert len(held) == BUDGET and not held.contended
            short = await _claim(engine, daemon="d2")  # while the first still holds its rows
            assert short == [] and short.contended
        rest = await _claim(engine, daemon="d2")
        assert len(rest) == 20 - BUDGET and not rest.contended
        assert await _claim(engine, daemon="d3") == []
    finally:
        await engine.dispose()


async def test_the_tables_empty_once_nothing_is_pending(pg_engine):
    engine = make_async_engine(pg_engine.url.render_as_string(hide_password=False))
    try:
        with pg_engine.begin() as conn:
            _insert(conn, endpoints=40, per=3, origins=4)
        claimed: list[leases.Claimed] = []
        while batch := await _claim(engine, cap=1_000):
            claimed += batch
            await _complete(engine, batch, "delivered")
        assert len(claimed) == 120 and len({m.id for m in claimed}) == 120
        await _claim(engine)  # visits what the last batch left and finds nothing
        with pg_engine.connect() as conn:
            left = conn.execute(text("SELECT (SELECT count(*) FROM outbox_due_endpoints),"
                                     " (SELECT count(*) FROM outbox_due_origins)")).one()
        assert tuple(left) == (0, 0)
    finally:
        await engine.dispose()


async def test_a_claim_counts_the_due_rows_it_takes_out_of_the_way_without_leasing_there(pg_engine):
    """``retired`` tells the claimer to claim again at once: a due row with nothing to lease
    now (its work cancelled, or its breaker open) that the claim dropped or moved past now.
    A claim that empties an endpoint by leasing its last message retires nothing, so steady
    traffic pays no extra claim; and what was retired is not counted twice."""
    engine = make_async_engine(pg_engine.url.render_as_string(hide_password=False))
    try:
        with pg_engine.begin() as conn:
            _insert(conn, endpoints=3)
        leased = await _claim(engine)
        assert (len(leased), leased.retired) == (3, 0)
        await _complete(engine, leased, "delivered")
        with pg_engine.begin() as conn:  # five endpoints' work folded in, then cancelled unclaimed
            _insert(conn, endpoints=5)
        with pg_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(_STATEMENTS[True].gather_due)
            conn.execute(text("UPDATE outbox_messages SET state = 'dead', dead_reason = 'cancelled' "
                              "WHERE state = 'pending'"))
        cancelled = await _claim(engine)
        assert (len(cancelled), cancelled.retired) == (0, 5 + 1), "five endpoints and their origin dropped"
        assert (await _claim(engine)).retired == 0
        with pg_engine.begin() as conn:
            _insert(conn, endpoints=1)
        await _breaker(engine, "t0", open_for=60)
        blocked = await _claim(engine)
        assert (len(blocked), blocked.retired) == (0, 1 + 1), "the endpoint and its origin wait for the breaker"
        assert (await _claim(engine)).retired == 0
    finally:
        await engine.dispose()


_OPS = st.lists(st.one_of(
    st.tuples(st.just("enqueue"), st.integers(0, 5), st.sampled_from([-5.0, 0.0, 30.0])),
    st.tuples(st.just("claim"), st.integers(1, 6), st.integers(1, 4)),
    st.tuples(st.just("retry"), st.integers(0, 3), st.sampled_from([-1.0, 30.0])),
    st.tuples(st.just("deliver"), st.integers(0, 3), st.just(0.0)),
    st.tuples(st.just("breaker"), st.integers(0, 5), st.sampled_from([None, -1.0, 30.0])),
    st.tuples(st.just("replay"), st.integers(0, 3), st.just(0.0)),
), min_size=1, max_size=25)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
# The origin's free slots all go to endpoints behind open breakers, ahead of one that may send:
# the claim leases nothing, and only its count of retired rows says to claim again at once.
@example(ops=[("enqueue", 0, -5.0), ("enqueue", 1, -5.0), ("enqueue", 2, 0.0), ("breaker", 0, 30.0),
              ("breaker", 1, 30.0), ("claim", 1, 2), ("claim", 1, 2)])
def test_no_due_message_is_ever_hidden_from_the_claim(pg_engine, ops):
    """After any history, every pending message is covered by an endpoint row due no later
    than it (or than its breaker's end), under an origin row due no later than that; and a
    claim without limits then takes exactly the due messages of open endpoints."""
    with pg_engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox_messages, outbox_breakers, outbox_due_origins, outbox_due_endpoints, "
                          "outbox_due_arrivals"))
    asyncio.run(_replay_history(pg_engine, ops))


async def _replay_history(pg_engine: Any, ops: Sequence[tuple[str, int, Any]]) -> None:
    engine = make_async_engine(pg_engine.url.render_as_string(hide_password=False))
    held: list[leases.Claimed] = []
    try:
        for op, n, arg in ops:
            if op == "enqueue":
                with pg_engine.begin() as conn:
                    conn.execute(text("INSERT INTO outbox_messages (tenant_id, url, idempotency_key, body, "
                                      "next_attempt_at) VALUES (:t, :u, :k, 'x', extract(epoch from now()) + :d)"),
                                 {"t": f"t{n}", "u": ORIGIN + "/hook", "k": uuid.uuid4().hex, "d": arg})
            elif op == "claim":
                batch = await _claim(engine, limit=n, cap=arg, held=held)
                assert not batch.contended, "a claim no other claim races comes back whole"
                if not batch and not batch.retired and len(held) < arg:
                    await _check_nothing_claimable(pg_engine)  # the claimer would sleep: rightly
                held += batch
            elif op in ("retry", "deliver") and held:
                done = [held.pop(n % len(held))]
                await _complete(engine, done, "pending" if op == "retry" else "delivered", next_in=arg)
            elif op == "breaker":
                await _breaker(engine, f"t{n}", arg)
            elif op == "replay":
                async with engine.begin() as conn:
                    await store.replay(conn, [n + 1], force=True, horizon_seconds=86_400)
            await _check_cover(pg_engine)
        await _check_claim_takes_all_due(pg_engine, engine)
    finally:
        await engine.dispose()


async def _check_cover(pg_engine: Any) -> None:
    with pg_engine.begin() as conn:
        conn.execute(_STATEMENTS[True].gather_due)
        uncovered = conn.execute(text("""
            SELECT m.id, m.tenant_id, m.next_attempt_at, e.due AS endpoint_due, o.due AS origin_due
            FROM outbox_messages AS m
            LEFT JOIN outbox_breakers AS b ON b.tenant_id = m.tenant_id AND b.origin = m.origin
            LEFT JOIN outbox_due_endpoints AS e ON e.tenant_id = m.tenant_id AND e.origin = m.origin
            LEFT JOIN outbox_due_origins AS o ON o.origin = m.origin
            WHERE m.state = 'pending' AND (e.due IS NULL OR o.due IS NULL OR o.due > e.due
                OR e.due > GREATEST(m.next_attempt_at,
                                    CASE b.state WHEN 'open' THEN b.open_until WHEN 'half_open' THEN b.probe_until END))
        """)).all()
    assert not uncovered, uncovered


async def _check_nothing_claimable(pg_engine: Any) -> None:
    """A claim that leased nothing and retired nothing (and was not passed over for its
    budget) found nothing that may be sent now: every due message waits behind a breaker."""
    with pg_engine.connect() as conn:
        claimable = conn.execute(text("""
            SELECT m.id FROM outbox_messages AS m
            LEFT JOIN outbox_breakers AS b ON b.tenant_id = m.tenant_id AND b.origin = m.origin
            WHERE m.state = 'pending' AND m.next_attempt_at <= extract(epoch from now())
              AND NOT COALESCE(b.state = 'open' AND b.open_until > extract(epoch from now()), false)
              AND NOT COALESCE(b.state = 'half_open' AND b.probe_until > extract(epoch from now()), false)
        """)).scalars().all()
    assert not claimable, claimable


async def _check_claim_takes_all_due(pg_engine: Any, engine: Any) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text("DELETE FROM outbox_breakers"))
        due = set(conn.execute(text("SELECT id FROM outbox_messages WHERE state = 'pending'"
                                    " AND next_attempt_at <= extract(epoch from now())")).scalars())
    taken = await _claim(engine, limit=10_000, cap=10_000, daemon="everything")
    assert {m.id for m in taken} == due


async def test_concurrent_claimers_and_producers_take_everything_once(pg_engine):
    """Three daemons claim and deliver while a producer keeps committing work for 200
    endpoints of four origins: every message is claimed exactly once, none is left behind,
    and the tables empty at the end (no claim hid work from another, none deadlocked)."""
    total = 600
    engines = [make_async_engine(pg_engine.url.render_as_string(hide_password=False)) for _ in range(3)]
    taken: list[int] = []
    produced = asyncio.Event()

    async def produce() -> None:
        for start in range(0, total, 20):  # thirty seller transactions of twenty messages
            await asyncio.to_thread(_commit_batch, pg_engine, start, 20)
        produced.set()

    async def daemon(engine: Any, name: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120
        while loop.time() < deadline:
            batch = await _claim(engine, limit=25, cap=4, daemon=name)
            taken.extend(m.id for m in batch)
            await _complete(engine, batch, "delivered")
            if produced.is_set() and not batch and len(taken) >= total:
                return
            if not batch:
                await asyncio.sleep(0.01)

    try:
        await asyncio.gather(produce(), *(daemon(e, f"d{i}") for i, e in enumerate(engines)))
        assert len(taken) == total and len(set(taken)) == total
        await _claim(engines[0])  # the last visit drops what has nothing pending
        with pg_engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM outbox_messages WHERE state <> 'delivered'")).scalar() == 0
            assert conn.execute(text("SELECT (SELECT count(*) FROM outbox_due_endpoints)"
                                     " + (SELECT count(*) FROM outbox_due_origins)")).scalar() == 0
    finally:
        for engine in engines:
            await engine.dispose()


def _commit_batch(pg_engine: Any, start: int, count: int) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text("""
            INSERT INTO outbox_messages (tenant_id, url, idempotency_key, body)
            SELECT 't' || (g % 200), 'https://buyer-' || (g % 4) || '.example.com/hook', 'whk_c_' || g, 'x'
            FROM generate_series(CAST(:a AS int), CAST(:b AS int)) AS g"""), {"a": start, "b": start + count - 1})
