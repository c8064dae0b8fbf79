"""How the completer batches outcomes, on both databases, with the default settings.

A round of ``OUTBOX_CONCURRENCY`` outcomes starts a flush early; the flush then records every
outcome waiting, up to ``FLUSH_MAX``. Unrecorded outcomes hold leases the claimer counts
against its budget, so flushes of one round each, while more waited, kept a daemon sending to
many origins waiting out one flush after another (docs/performance.md, "Design choices, each
measured against the alternative"). On PostgreSQL a flush of the common kind waits for three
answers from the database, not one per statement.
"""

from __future__ import annotations

import asyncio

import pytest
import structlog.testing
from sqlalchemy import func, select

import outbox
from outbox import store
from outbox.db import make_async_engine
from outbox.schema import messages
from sinks.fanout import SinkFanout
from supervisor.cycle.attempt import Outcome
from supervisor.cycle.completer import FLUSH_MAX, Completer
from supervisor.cycle.outage import OutageGuard
from supervisor.observe.metrics import Metrics

from tests.db_proxies import TurnCountingProxy, stalling_proxy
from tests.ledger import enqueue_batch, message_key

WAITING = FLUSH_MAX + 50  # more than one flush may take


async def test_a_flush_records_every_outcome_waiting_up_to_its_maximum(engine):
    url = engine.url.render_as_string(hide_password=False)
    enqueue_batch(engine, [("t1", "https://buyer.example.com/hook", message_key("batch", i)) for i in range(WAITING)])
    settings = outbox.load_settings(env={"OUTBOX_DATABASE_URL": url})
    assert settings.concurrency < FLUSH_MAX, "a round must be smaller than a flush for this test to judge"
    aengine = make_async_engine(url)
    completer = Completer(aengine, settings=settings, daemon_id="unit", metrics=Metrics(),
                          fanout=SinkFanout([], timeout=1), outage=OutageGuard(5))
    sizes: list[int] = []
    record = completer.flush

    async def counted(batch):
        sizes.append(len(batch))
        await record(batch)

    completer.flush = counted  # type: ignore[method-assign]
    runner = None
    try:
        async with aengine.begin() as conn:
            claimed = await store.claim(conn, limit=WAITING, lease_seconds=30, horizon_seconds=86_400,
                                        daemon_id="unit", endpoint_concurrency=WAITING)
        assert len(claimed) == WAITING
        for m in claimed:  # every request answered before the completer gets to them
            completer.submit(Outcome(m, "delivered", "success", http_status=200, sent=True))
        runner = asyncio.create_task(completer.run())
        for _ in range(200):
            if sum(sizes) == WAITING and completer.backlog == 0:
                break
            await asyncio.sleep(0.05)
    finally:
        if runner is not None:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        await completer.aclose()
        await aengine.dispose()
    # One round (64) would start each flush early and take no more: 64, 64, 64, 58.
    assert sizes == [FLUSH_MAX, WAITING - FLUSH_MAX], sizes
    with engine.connect() as conn:
        delivered = conn.execute(select(func.count()).where(messages.c.state == "delivered")).scalar_one()
    assert delivered == WAITING


async def test_a_flush_waits_for_three_answers_from_postgresql(pg_engine, pg_url):
    """The clock (with ``BEGIN``), the completion's ``UPDATE ... RETURNING``, then the attempt
    rows, the endpoint statistics and the ``COMMIT`` together: three round trips, whatever
    the batch's size (one per statement before: six)."""
    enqueue_batch(pg_engine, [(f"t{i % 3}", "https://buyer.example.com/hook", message_key("trips", i))
                              for i in range(50)])
    with stalling_proxy(pg_url, TurnCountingProxy) as (proxy, url):
        settings = outbox.load_settings(env={"OUTBOX_DATABASE_URL": url})
        aengine = make_async_engine(url)
        completer = Completer(aengine, settings=settings, daemon_id="unit", metrics=Metrics(),
                              fanout=SinkFanout([], timeout=1), outage=OutageGuard(5))
        try:
            async with aengine.begin() as conn:
                claimed = await store.claim(conn, limit=50, lease_seconds=30, horizon_seconds=86_400,
                                            daemon_id="unit", endpoint_concurrency=50)
            outcomes = [Outcome(m, "delivered", "success", http_status=200, sent=True) for m in claimed]
            await completer.flush(outcomes[:1])  # opens the completer's own connection
            assert isinstance(proxy, TurnCountingProxy)
            proxy.turns = 0
            await completer.flush(outcomes[1:])
            assert proxy.turns == 3, f"{proxy.turns} round trips for a flush of {len(outcomes) - 1}"
        finally:
            await completer.aclose()
            await aengine.dispose()
    with pg_engine.connect() as conn:
        assert conn.execute(select(func.count()).where(messages.c.state == "delivered")).scalar_one() == 50


async def test_a_breaker_move_is_counted_and_logged_only_once_its_flush_commits(pg_engine, pg_url):
    """A flush that trips a breaker and then fails (its transition row refused) neither counts
    nor logs the move, which was never recorded; the same flush, once it commits, counts and
    logs it once."""
    enqueue_batch(pg_engine, [("t1", "https://buyer.example.com/hook", message_key("trip", i)) for i in range(12)])
    settings = outbox.load_settings(env={"OUTBOX_DATABASE_URL": pg_url})
    with pg_engine.begin() as conn:
        conn.exec_driver_sql("CREATE FUNCTION test_refuse_move() RETURNS trigger LANGUAGE plpgsql AS "
                             "$$ BEGIN RAISE EXCEPTION 'move refused'; END $$")
        conn.exec_driver_sql("CREATE TRIGGER test_refuse_move BEFORE INSERT ON outbox_breaker_transitions "
                             "FOR EACH ROW EXECUTE FUNCTION test_refuse_move()")
    aengine = make_async_engine(pg_url)
    metrics = Metrics()
    completer = Completer(aengine, settings=settings, daemon_id="unit", metrics=metrics,
                          fanout=SinkFanout([], timeout=1), outage=OutageGuard(5))

    def counted() -> float:
        return metrics.registry.get_sample_value("outbox_breaker_transitions_total",
                                                 {"from_state": "closed", "to_state": "open"}) or 0.0

    try:
        async with aengine.begin() as conn:
            claimed = await store.claim(conn, limit=12, lease_seconds=30, horizon_seconds=86_400,
                                        daemon_id="unit", endpoint_concurrency=12)
        batch = [Outcome(m, "retry", "failed", http_status=503, sent=True) for m in claimed]
        assert len(batch) >= settings.breaker_failure_threshold
        with structlog.testing.capture_logs() as logs:
            with pytest.raises(Exception, match="move refused"):
                await completer.flush(batch)
            refused = len(logs)
            with pg_engine.begin() as conn:
                conn.exec_driver_sql("DROP TRIGGER test_refuse_move ON outbox_breaker_transitions")
            assert counted() == 0
            await completer.flush(batch)
        moves = [(i, e["from_state"], e["to_state"]) for i, e in enumerate(logs) if e["event"] == "breaker.transition"]
        assert [(before, after) for _, before, after in moves] == [("closed", "open")]
        assert moves[0][0] >= refused, "the refused flush logged a move it never recorded"
        assert counted() == 1
    finally:
        with pg_engine.begin() as conn:
            conn.exec_driver_sql("DROP TRIGGER IF EXISTS test_refuse_move ON outbox_breaker_transitions")
            conn.exec_driver_sql("DROP FUNCTION test_refuse_move()")
        await completer.aclose()
        await aengine.dispose()
