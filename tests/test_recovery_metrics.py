"""Deaths by expiry, lease rescues and database outages show up in the metrics.

Expiry is the commonest death, so the dashboard's dead rate (``outbox_deliveries_total
{outcome="dead"}``) must include it; rescues and outages are what an operator looks for
after a crash or a failover.
"""

from __future__ import annotations

import asyncio

from sqlalchemy import select

from outbox.db import make_async_engine
from outbox.schema import messages
from supervisor.cycle.maintenance import Maintenance
from supervisor.observe.metrics import Metrics
from supervisor.cycle.outage import OutageGuard

from tests.ledger import enqueue_many


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def test_expired_and_rescued_messages_are_counted(engine):
    enqueue_many(engine, "http://127.0.0.1:9", ["/a", "/b", "/c"], tenants=3)
    with engine.begin() as conn:  # 1 enqueued longer ago than its horizon; 2 leased by a daemon that died
        conn.execute(messages.update().where(messages.c.id == 1).values(created_at=1.0))
        conn.execute(messages.update().where(messages.c.id == 2).values(
            state="in_flight", lease_token="t", lease_expires_at=1.0, leased_by="dead-daemon", attempts=1))
    metrics = Metrics(per_tenant=True)
    async_engine = make_async_engine(engine.url.render_as_string(hide_password=False))
    task = asyncio.create_task(Maintenance(async_engine, daemon_id="d", metrics=metrics,
                                           outage=OutageGuard(5), horizon_seconds=86_400).run())
    try:
        deadline = asyncio.get_running_loop().time() + 30  # the first tick does both; a loaded CI is slow
        while asyncio.get_running_loop().time() < deadline:
            if sample(metrics, "outbox_lease_rescues_total") and sample(
                    metrics, "outbox_deliveries_total", outcome="dead", tenant="tenant-0"):
                break
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await async_engine.dispose()
    assert sample(metrics, "outbox_deliveries_total", outcome="dead", tenant="tenant-0") == 1
    assert sample(metrics, "outbox_dead_letters_total", reason="expired") == 1
    assert sample(metrics, "outbox_lease_rescues_total") == 1
    with engine.connect() as conn:
        assert conn.execute(select(messages.c.state).order_by(messages.c.id)).scalars().all() == [
            "dead", "pending", "pending"]


async def test_an_outage_is_counted_once_however_many_calls_fail():
    metrics = Metrics()
    guard = OutageGuard(60, on_outage=metrics.database_outages.inc)
    for _ in range(3):
        await guard.failed("claim", ConnectionError("refused"))
    guard.ok("claim")
    await guard.failed("claim", ConnectionError("refused"))
    assert sample(metrics, "outbox_database_outages_total") == 2
