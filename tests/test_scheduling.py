"""Scheduling rules of the claim, the horizon and the breaker rows, on PostgreSQL and SQLite.

The claim takes only what may be sent (per-origin capacity, open breakers passed over,
oldest due first per endpoint, fair across endpoints); the horizon counts from enqueue;
breaker rows keep every failure when two daemons record at once; purge never deletes a
row a replay just made pending.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from sqlalchemy import select, text, update

from outbox import store
from outbox.db import make_async_engine, make_engine
from outbox.schema import breakers, messages
from supervisor.breaker import CircuitBreakerPolicy, apply_outcomes, closed_row
from tests.test_db_faults import enqueue_batch, message_key

HORIZON = 86_400


def _url(engine) -> str:
    return engine.url.render_as_string(hide_password=False)


async def _claim(engine, *, limit: int = 50, cap: int = 3, daemon: str = "d1") -> list[store.Claimed]:
    async with engine.begin() as conn:
        return await store.claim(conn, limit=limit, lease_seconds=30, horizon_seconds=HORIZON, daemon_id=daemon,
                                 endpoint_concurrency=cap)


async def test_claim_applies_origin_capacity_fairly_and_oldest_first(engine):
    a, b = "https://a.example.com/hook", "https://b.example.com/hook"
    enqueue_batch(engine, [("t1", a, message_key("a1", i)) for i in range(10)])
    enqueue_batch(engine, [("t2", a, message_key("a2", i)) for i in range(10)])
    enqueue_batch(engine, [("t3", b, message_key("b3", i)) for i in range(5)])
    aengine = make_async_engine(_url(engine))
    try:
        first = await _claim(aengine, cap=3)
        by_origin = {o: [m for m in first if m.origin == o] for o in ("https://a.example.com", "https://b.example.com")}
        assert len(by_origin["https://a.example.com"]) == 3 and len(by_origin["https://b.example.com"]) == 3
        # Origin a's slots go round-robin across its tenants, each tenant oldest first.
        tenants = [m.tenant_id for m in sorted(by_origin["https://a.example.com"], key=lambda m: m.id)]
        assert sorted(tenants) == ["t1", "t1", "t2"] or sorted(tenants) == ["t1", "t2", "t2"]
        for tenant in ("t1", "t2", "t3"):
            keys = [m.idempotency_key for m in first if m.tenant_id == tenant]
            assert keys == sorted(keys) and (not keys or keys[0].endswith("00000000")), keys
        assert await _claim(aengine, cap=3) == [], "at capacity: nothing more is claimed (none to hand back)"
        other = await _claim(aengine, cap=3, daemon="d2")
        assert len(other) == 3 + 2, "capacity is per daemon: another daemon has its own slots"
        # A limit smaller than the capacity takes every origin's first slot before any second.
        async with aengine.begin() as conn:
            await conn.execute(update(messages).where(messages.c.state == "in_flight").values(
                state="pending", lease_token=None, leased_by=None, lease_expires_at=None))
        small = await _claim(aengine, limit=2, cap=3)
        assert {m.origin for m in small} == {"https://a.example.com", "https://b.example.com"}
    finally:
        await aengine.dispose()


async def test_claim_passes_over_an_open_breaker_and_takes_one_probe_after_it(engine):
    url = "https://sick.example.com/hook"
    enqueue_batch(engine, [("t1", url, message_key("sick", i)) for i in range(20)])
    aengine = make_async_engine(_url(engine))
    try:
        async with aengine.begin() as conn:
            now = await store.db_now(conn)
            await store.save_breakers(conn, [{**closed_row("t1", "https://sick.example.com"), "state": "open",
                                              "trips": 1, "open_until": now + 60, "updated_at": now}])
        assert await _claim(aengine, cap=8) == [], "an open breaker's endpoint is passed over"
        async with aengine.begin() as conn:
            await conn.execute(update(breakers).values(open_until=now - 1))
        probe = await _claim(aengine, cap=8)
        assert len(probe) == 1 and probe[0].breaker_state == "open", "once the open period is over: one probe"
        assert probe[0].idempotency_key == message_key("sick", 0)
        async with aengine.begin() as conn:
            assert await store.acquire_probe(conn, "t1", "https://sick.example.com", 30)
        assert await _claim(aengine, cap=8) == [], "half-open with its probe out: nothing more"
    finally:
        await aengine.dispose()


async def test_horizon_counts_from_enqueue_and_expiry_needs_no_attempt(engine):
    url = "https://buyer.example.com/hook"
    enqueue_batch(engine, [("t1", url, message_key("old", i)) for i in range(3)])
    enqueue_batch(engine, [("t1", url, message_key("new", 0))])
    with engine.begin() as conn:
        conn.execute(update(messages).where(messages.c.idempotency_key.like("%old%"))
                     .values(created_at=messages.c.created_at - HORIZON - 5))
    aengine = make_async_engine(_url(engine))
    try:
        async with aengine.begin() as conn:
            expired = await store.expire_past_horizon(conn, horizon_seconds=HORIZON)
        assert len(expired) == 3, "never attempted, enqueued longer ago than the horizon: dead"
        claimed = await _claim(aengine)
        assert [m.idempotency_key for m in claimed] == [message_key("new", 0)]
        assert claimed[0].retry_until == pytest.approx(claimed[0].created_at + HORIZON), "claiming starts no clock"
        with engine.connect() as conn:
            reasons = conn.execute(select(messages.c.dead_reason).where(messages.c.state == "dead")).scalars().all()
        assert reasons == ["expired"] * 3
    finally:
        await aengine.dispose()


async def test_breaker_row_created_by_two_daemons_at_once_keeps_both_failures(engine):
    """Two flushes record the first failure of the same endpoint concurrently."""
    from supervisor.completer import Completer

    key = ("t1", "https://buyer.example.com")
    policy = CircuitBreakerPolicy()
    engines = [make_async_engine(_url(engine)) for _ in range(2)]
    started = asyncio.Barrier(2)

    async def record(aengine) -> None:
        async with aengine.begin() as conn:
            await started.wait()  # both transactions are open before either writes
            now = await store.db_now(conn)
            await store.ensure_breakers(conn, [key])
            row = (await store.lock_breakers(conn, [key]))[key]
            new, _ = apply_outcomes(row, [False], now=now, policy=policy)
            await store.save_breakers(conn, [new])

    try:
        if engine.dialect.name == "sqlite":  # one writer at a time: the barrier must not hold the lock
            for aengine in engines:
                started = asyncio.Barrier(1)
                await record(aengine)
        else:
            await asyncio.gather(*(record(e) for e in engines))
        with engine.connect() as conn:
            row = conn.execute(select(breakers)).mappings().one()
        assert row["window_failures"] == 2 and row["failures"] == 2, dict(row)
        assert Completer  # the completer runs exactly this sequence (ensure, lock, fold, save)
    finally:
        for aengine in engines:
            await aengine.dispose()


def test_purge_keeps_a_row_a_concurrent_forced_replay_made_pending(pg_engine):
    """The replay holds the row locked when purge's subquery picks it; purge must re-check."""
    url = "https://buyer.example.com/hook"
    enqueue_batch(pg_engine, [("t1", url, message_key("purge", 0))])
    with pg_engine.begin() as conn:
        conn.execute(update(messages).values(state="delivered", finished_at=messages.c.created_at - 10 * HORIZON,
                                             created_at=messages.c.created_at - 10 * HORIZON,
                                             retry_until=messages.c.created_at - 9 * HORIZON))
    deleted: list[int] = []
    replayer = make_engine(_url(pg_engine))
    with replayer.connect() as replay_conn:
        replay_tx = replay_conn.begin()
        replay_conn.execute(text("UPDATE outbox_messages SET state = 'pending', finished_at = NULL, "
                                 "trigger = 'replay', retry_until = NULL"))

        def purge() -> None:
            async def run() -> None:
                aengine = make_async_engine(_url(pg_engine))
                async with aengine.begin() as conn:
                    deleted.append(await store.purge_batch(conn, older_than=60, horizon_seconds=HORIZON, limit=10))
                await aengine.dispose()
            asyncio.run(run())

        worker = threading.Thread(target=purge)
        worker.start()
        time.sleep(1.0)  # purge is now waiting on the replay's row lock
        replay_tx.commit()
        worker.join(20)
    replayer.dispose()
    assert deleted == [0]
    with pg_engine.connect() as conn:
        assert conn.execute(select(messages.c.state)).scalar_one() == "pending"
