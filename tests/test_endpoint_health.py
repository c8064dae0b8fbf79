"""Endpoint health: the per-minute rollup agrees with the attempt log, on both databases and
through the real daemon, and its quantiles and Prometheus series stay within their bounds."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings as hsettings, strategies as st
from sqlalchemy import func, select

import outbox
from outbox.db import make_async_engine
from outbox.schema import LATENCY_BOUNDS_MS, attempts, endpoint_stats, messages, operator_events
from outbox.store import db_now
from supervisor.observe import health_stats
from supervisor.observe.health_stats import Recorded, bucket_of, endpoint_health, quantile, tally
from supervisor.cycle.maintenance import sample_gauges
from supervisor.observe.metrics import Metrics
from tests import procs
from tests.ledger import PRODUCER



@given(st.lists(st.integers(min_value=0, max_value=60_000), min_size=1, max_size=300),
       st.sampled_from([0.5, 0.95]))
@hsettings(max_examples=200, deadline=None)
def test_a_quantile_lies_in_the_bucket_of_the_true_one(latencies, q):
    histogram = [0] * (len(LATENCY_BOUNDS_MS) + 1)
    for ms in latencies:
        histogram[bucket_of(ms)] += 1
    true = sorted(latencies)[max(int(q * len(latencies) + 0.999999) - 1, 0)]  # the nearest-rank quantile
    estimate = quantile(histogram, q)
    i = bucket_of(true)
    low = 0 if i == 0 else LATENCY_BOUNDS_MS[i - 1]
    high = LATENCY_BOUNDS_MS[i] if i < len(LATENCY_BOUNDS_MS) else low
    assert low <= estimate <= high, (estimate, true)


def _recorded(tenant: str, origin: str, n: int, *, ok: bool, ms: int, died: bool = False) -> list[Recorded]:
    return [Recorded.of(tenant, origin, "success" if ok else "failed", ms, died) for _ in range(n)]


async def test_rows_add_up_per_minute_and_daemon_and_the_window_sums_them(engine):
    """The upsert adds (never overwrites) on either database, each daemon to its own row;
    a window sees its minutes only, and pruning drops what is past the retention."""
    async_engine = make_async_engine(engine.url.render_as_string(hide_password=False))
    try:
        async with async_engine.begin() as conn:
            now = await db_now(conn)
            a, b = ("acme", "https://a.example"), ("acme", "https://b.example")
            for daemon in ("d1", "d2"):
                await health_stats.record(conn, tally(
                    _recorded(*a, 3, ok=True, ms=40) + _recorded(*a, 1, ok=False, ms=900, died=True)
                    + _recorded(*b, 2, ok=False, ms=20), now=now, daemon_id=daemon))
            await health_stats.record(conn, tally(_recorded(*a, 5, ok=True, ms=40), now=now, daemon_id="d1"))
            # a timeout counts as a failure and raises the slowest answer; an abandoned attempt neither
            await health_stats.record(conn, tally([Recorded.of(*b, "timeout", 1500, False),
                                                   Recorded.of(*b, "abandoned", 3000, False)], now=now, daemon_id="d2"))
            s = endpoint_stats.c
            current = {(r.origin, r.daemon_id): (r.failures, r.latency_ms_max) for r in await conn.execute(
                select(s.origin, s.daemon_id, s.failures, s.latency_ms_max).where(s.minute == int(now // 60)))}
            # ten minutes ago: inside an hour's window, outside a five-minute one
            await health_stats.record(conn, tally(_recorded(*b, 4, ok=True, ms=5), now=now - 600, daemon_id="d1"))
            # two days ago: past the retention
            await health_stats.record(conn, tally(_recorded(*b, 7, ok=True, ms=5), now=now - 2 * 86400,
                                                  daemon_id="d1"))
        async with async_engine.begin() as conn:
            hour = {(h.tenant_id, h.origin): h for h in await endpoint_health(conn, window_seconds=3600)}
            recent = {(h.tenant_id, h.origin): h for h in await endpoint_health(conn, window_seconds=300)}
            assert await health_stats.prune(conn) == 1
            assert (await conn.execute(select(func.count()).select_from(endpoint_stats))).scalar() == 5
        assert list(hour) == [a, b]  # busiest first
        assert (hour[a].attempts, hour[a].successes, hour[a].deaths) == (13, 11, 2)
        assert hour[a].success_rate == pytest.approx(11 / 13)
        assert 25 <= hour[a].latency_p50_ms <= 50 and 500 <= hour[a].latency_p95_ms <= 1000
        assert (hour[b].attempts, hour[b].successes, recent[b].attempts, recent[b].successes) == (10, 4, 6, 0)
        # The second flush's 40 ms did not lower the first's 900 ms; the timeout raised 20 to 1500.
        assert current == {(a[1], "d1"): (1, 900), (a[1], "d2"): (1, 900), (b[1], "d1"): (2, 20),
                           (b[1], "d2"): (3, 1500)}
        assert hour[a].breaker_state == "closed" and hour[a].as_dict()["breaker_open_until"] is None
        with pytest.raises(ValueError):
            async with async_engine.connect() as conn:
                await endpoint_health(conn, window_seconds=2 * 86400)
    finally:
        await async_engine.dispose()


async def test_the_prometheus_series_are_off_by_default_and_at_most_the_top_n(pg_engine):
    async_engine = make_async_engine(pg_engine.url.render_as_string(hide_password=False))
    try:
        async with async_engine.begin() as conn:
            now = await db_now(conn)
            await health_stats.record(conn, tally(
                [r for i in range(5) for r in _recorded(f"t{i}", "https://x.example", i + 1, ok=True, ms=30)],
                now=now, daemon_id="d"))
        default = Metrics()
        await sample_gauges(async_engine, default)
        assert not any(m.name.startswith("outbox_endpoint_") for m in default.registry.collect())
        top = Metrics(endpoint_top=2)
        await sample_gauges(async_engine, top)
        labelled = {s.labels["tenant"]: s.value for m in top.registry.collect() if m.name == "outbox_endpoint_attempts"
                    for s in m.samples}
        assert labelled == {"t4": 5, "t3": 4}
        assert top.registry.get_sample_value("outbox_endpoint_success_ratio", {"tenant": "t4",
                                                                               "origin": "https://x.example"}) == 1
    finally:
        await async_engine.dispose()


@pytest.mark.e2e
def test_endpoints_shows_what_the_attempt_log_holds(pg_engine, pg_url, tmp_path, keypair):
    """Three tenants' endpoints through the real daemon: one healthy, one whose messages die
    at once (410), one failing until its breaker opens. ``outboxd endpoints --json`` agrees
    with the attempt log row for row, and shows the open breaker."""
    key, jwks = keypair
    with procs.receiver(tmp_path, jwks) as (port, log):
        base = f"http://127.0.0.1:{port}"
        env = procs.daemon_env(pg_url, key)
        with pg_engine.begin() as conn:
            for tenant, path, n in (("well", "/ok", 30), ("gone", "/status/410", 5), ("sick", "/status/500", 40)):
                for i in range(n):
                    outbox.enqueue_task_webhook(
                        conn, tenant_id=tenant, task_id=f"{tenant}{i}", task_type="create_media_buy",
                        status="completed", settings=PRODUCER,
                        push_notification_config={"url": f"{base}{path}?i={i}", "operation_id": "op"})
        daemon = procs.start_daemon(env, tmp_path / "d.log")
        try:
            def settled() -> bool:
                with pg_engine.connect() as conn:
                    done = conn.execute(select(func.count()).where(messages.c.tenant_id.in_(["well", "gone"]),
                                                                   messages.c.state.in_(["delivered", "dead"]))
                                        ).scalar()
                    tripped = conn.execute(select(func.count()).select_from(outbox.schema.breakers).where(
                        outbox.schema.breakers.c.state == "open")).scalar()
                return done == 35 and tripped == 1
            assert procs.wait_until(settled, 60)
        finally:
            assert procs.stop(daemon) == 0
    result = procs.outboxd(env, "endpoints", "--json", "--window", "15m", exit_code=0)
    shown = {h["tenant_id"]: h for h in json.loads(result.stdout)}
    with pg_engine.connect() as conn:
        logged = dict(conn.execute(select(attempts.c.tenant_id, func.count()).group_by(attempts.c.tenant_id)).all())
        ok = dict(conn.execute(select(attempts.c.tenant_id, func.count()).where(attempts.c.outcome == "success")
                               .group_by(attempts.c.tenant_id)).all())
    origin = f"http://127.0.0.1:{port}"
    assert set(shown) == {"well", "gone", "sick"} and {h["origin"] for h in shown.values()} == {origin}
    for tenant, h in shown.items():
        assert h["attempts"] == logged[tenant], tenant
        assert h["successes"] == ok.get(tenant, 0), tenant
        assert h["latency_p50_ms"] is not None and h["latency_p95_ms"] >= h["latency_p50_ms"]
    assert shown["well"]["success_rate"] == 1.0 and shown["well"]["deaths"] == 0
    assert shown["gone"]["deaths"] == 5 and shown["gone"]["success_rate"] == 0.0
    assert shown["sick"]["breaker_state"] == "open" and shown["sick"]["breaker_open_until"].endswith("Z")
    text = procs.outboxd(env, "endpoints", "--tenant", "sick")
    assert text.returncode == 0 and f"sick@{origin}" in text.stdout and "open" in text.stdout
    assert "well@" not in text.stdout
    with pg_engine.connect() as conn:  # the deaths also raised one operator event (recorded in the same flushes)
        dead_events = conn.execute(select(operator_events.c.count).where(
            operator_events.c.kind == "messages.dead", operator_events.c.tenant_id == "gone")).scalars().all()
    assert sum(dead_events) == 5  # one event per window (two if the deaths straddle a window edge)
    bad = procs.outboxd(env, "endpoints", "--window", "3d")
    assert bad.returncode == 2 and "--window" in bad.stderr  # a usage error, as argparse exits


async def test_a_breaker_past_its_open_period_reads_half_open_everywhere(pg_engine):
    """An open breaker whose open period has ended admits a probe: it is half-open although
    its row says ``open`` until a probe is taken (an endpoint no longer sent to never takes
    one). The gauge, ``endpoints``, ``breakers list`` and ``status`` say what it does now."""
    from outbox.schema import breakers
    from supervisor.operator import ops
    async_engine = make_async_engine(pg_engine.url.render_as_string(hide_password=False))
    try:
        async with async_engine.begin() as conn:
            now = await db_now(conn)
            row = {"failures": 10, "successes": 0, "trips": 1, "updated_at": now - 600}
            await conn.execute(breakers.insert(), [
                {**row, "tenant_id": "lapsed", "origin": "https://a.example", "state": "open", "open_until": now - 570},
                {**row, "tenant_id": "shut", "origin": "https://b.example", "state": "open", "open_until": now + 60}])
        metrics = Metrics()
        await sample_gauges(async_engine, metrics)
        gauge = {state: metrics.registry.get_sample_value("outbox_breakers", {"state": state})
                 for state in ("closed", "open", "half_open")}
        assert gauge == {"closed": 0, "open": 1, "half_open": 1}
        async with async_engine.connect() as conn:
            listed = {b["tenant_id"]: b["state"] for b in await ops.list_breakers(conn)}
            shown = {b["tenant_id"]: b["state"] for b in (await ops.status(conn))["open_breakers"]}
            health = {h.tenant_id: h.breaker_state for h in await endpoint_health(conn, window_seconds=3600)}
        assert listed == shown == health == {"lapsed": "half_open", "shut": "open"}
    finally:
        await async_engine.dispose()


async def test_delivery_lag_leaves_out_the_backlog_a_breaker_holds_back(pg_engine):
    """One buyer's outage is its breaker's alert, not the daemons' lag: the oldest due message
    behind a breaker that is not closed counts in ``outbox_oldest_due_message_age_seconds``
    but not in ``outbox_delivery_lag_seconds``, which is the oldest of the rest (0 when none)."""
    from outbox.schema import breakers
    from tests.ledger import enqueue_tasks
    held = enqueue_tasks(pg_engine, "down", "https://down.example/hook", 3)
    fine = enqueue_tasks(pg_engine, "up", "https://up.example/hook", 2)
    async_engine = make_async_engine(pg_engine.url.render_as_string(hide_password=False))
    try:
        async with async_engine.begin() as conn:
            now = await db_now(conn)
            await conn.execute(messages.update().where(messages.c.id.in_(held)).values(next_attempt_at=now - 900))
            await conn.execute(messages.update().where(messages.c.id.in_(fine)).values(next_attempt_at=now - 60))
            await conn.execute(breakers.insert().values(
                tenant_id="down", origin="https://down.example", state="open", failures=10, successes=0, trips=1,
                open_until=now - 5, updated_at=now))
        metrics = Metrics()
        before = [metrics.registry.get_sample_value(name) for name in (
            "outbox_oldest_due_message_age_seconds", "outbox_delivery_lag_seconds", "outbox_breakers_holding_back")]
        assert all(math.isnan(value) for value in before)  # not sampled yet (the database away): no 0 claimed
        await sample_gauges(async_engine, metrics)
        oldest = metrics.registry.get_sample_value("outbox_oldest_due_message_age_seconds")
        lag = metrics.registry.get_sample_value("outbox_delivery_lag_seconds")
        assert 900 <= oldest < 960 and 60 <= lag < 120
        async with async_engine.begin() as conn:
            await conn.execute(messages.update().where(messages.c.id.in_(fine)).values(state="delivered",
                                                                                       finished_at=now))
        await sample_gauges(async_engine, metrics)
        assert metrics.registry.get_sample_value("outbox_delivery_lag_seconds") == 0
        assert metrics.registry.get_sample_value("outbox_oldest_due_message_age_seconds") >= 900
    finally:
        await async_engine.dispose()


async def test_breakers_holding_back_counts_only_endpoints_with_work_waiting(pg_engine):
    """What ``OutboxBreakersOpen`` reads: a breaker open or half-open (probing: its probe out,
    or waiting for the next message to be one) that pending messages wait behind. A breaker
    of an endpoint nothing waits for any more holds back nothing, however it reads."""
    from outbox.schema import breakers
    from tests.ledger import enqueue_tasks
    enqueue_tasks(pg_engine, "down", "https://down.example/hook", 2)
    enqueue_tasks(pg_engine, "probing", "https://probing.example/hook", 1)
    async_engine = make_async_engine(pg_engine.url.render_as_string(hide_password=False))
    try:
        async with async_engine.begin() as conn:
            now = await db_now(conn)
            row = {"failures": 10, "successes": 0, "trips": 1, "updated_at": now}
            await conn.execute(breakers.insert(), [
                {**row, "tenant_id": "down", "origin": "https://down.example", "state": "open", "open_until": now + 60},
                {**row, "tenant_id": "probing", "origin": "https://probing.example", "state": "half_open",
                 "open_until": now - 5, "probe_until": now + 10},
                {**row, "tenant_id": "quiet", "origin": "https://quiet.example", "state": "open",
                 "open_until": now - 600}])
        metrics = Metrics()
        await sample_gauges(async_engine, metrics)
        assert metrics.registry.get_sample_value("outbox_breakers_holding_back") == 2
    finally:
        await async_engine.dispose()
