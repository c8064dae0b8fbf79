"""The console's charts and rates, read from the endpoint-health rollup, equal what the attempt
rows say after a real daemon run: successes, 500s, timeouts and an attempt abandoned at
shutdown, on PostgreSQL and SQLite. And migration 0016 adds the rollup's new columns to a
database that already has rows, on both."""

from __future__ import annotations

import pytest
from alembic import command
from sqlalchemy import func, inspect, select, text

from outbox.db import make_async_engine
from outbox.migrate import alembic_config, upgrade
from outbox.schema import attempts, endpoint_stats, messages
from outbox.store import db_now
from supervisor.ui.timeseries import DAY, HOUR, Scope, recent_totals, series
from tests import procs
from tests.console_history import attempt_rows, tally
from tests.ledger import task_webhook

# A short grace: a request still hanging at SIGTERM is abandoned, not timed out.
DAEMON = {"shutdown_grace_seconds": 0.2, "retry_base_seconds": 0.2}


def _enqueue(engine, tenant: str, url: str, count: int, prefix: str) -> None:
    with engine.begin() as conn:
        for i in range(count):
            task_webhook(conn, f"{prefix}{i}", f"{url}?i={i}", tenant=tenant)


def _count(engine, *where, table=attempts) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table).where(*where)).scalar_one())


def _run_daemon(engine, url: str, tmp_path, key) -> str:
    """Deliveries, failures, timeouts, then one request hanging at shutdown; the receiver's origin."""
    with procs.receiver(tmp_path, None) as (port, _):
        origin = f"http://127.0.0.1:{port}"
        _enqueue(engine, "good", f"{origin}/ok", 12, "ok")
        _enqueue(engine, "good", f"{origin}/delay/120", 4, "slow")
        _enqueue(engine, "bad", f"{origin}/status/500", 3, "err")
        _enqueue(engine, "hung", f"{origin}/hang", 1, "hang")
        daemon = procs.start_daemon(procs.daemon_env(url, key, **DAEMON), tmp_path / "d.log")
        try:
            assert procs.wait_until(lambda: _count(engine, attempts.c.outcome == "success") == 16
                                    and _count(engine, attempts.c.outcome == "failed") >= 3
                                    and _count(engine, attempts.c.outcome == "timeout") >= 2, 60)
            _enqueue(engine, "late", f"{origin}/hang", 1, "late")  # its own breaker: claimed at once
            assert procs.wait_until(lambda: _count(engine, messages.c.state == "in_flight",
                                                   messages.c.tenant_id == "late", table=messages) == 1, 30)
        finally:
            assert procs.stop(daemon) == 0
    assert _count(engine, attempts.c.outcome == "abandoned", attempts.c.tenant_id == "late") == 1
    return origin


@pytest.mark.e2e
async def test_the_charts_and_rates_equal_the_attempt_rows_after_a_daemon_run(engine, tmp_path):
    key, _ = procs.make_key(tmp_path)
    url = engine.url.render_as_string(hide_password=False)
    origin = _run_daemon(engine, url, tmp_path, key)
    rows = attempt_rows(engine)
    timeouts = _count(engine, attempts.c.tenant_id == "hung", attempts.c.outcome == "timeout")
    aengine = make_async_engine(url)
    try:
        async with aengine.connect() as conn:
            now = await db_now(conn)
            for scope in (Scope(), Scope(tenant="bad"), Scope(tenant="good", origin=origin), Scope(tenant="hung"),
                          Scope(tenant="late")):
                for window in (HOUR, DAY):
                    drawn = await series(conn, window, scope, now)
                    for b in drawn.buckets:
                        truth = tally(rows, b.start, b.start + window.bucket, scope.tenant, scope.origin)
                        assert (b.delivered, b.failed, b.latency_max_ms) == \
                            (truth.delivered, truth.failed, truth.latency_max_ms), (scope, window.name, b)
                        assert b.latency_avg_ms == pytest.approx(truth.latency_avg_ms)
                recent = await recent_totals(conn, 300, scope, now)
                truth = tally(rows, (now // 60 - 5) * 60, now + 1, scope.tenant, scope.origin)
                assert (recent.delivered, recent.failed) == (truth.delivered, truth.failed), scope
                assert recent.daemons == 1 and recent.seconds == pytest.approx(300 + now % 60)
            hung, late = [await series(conn, HOUR, Scope(tenant=t), now) for t in ("hung", "late")]
            assert hung.delivered == 0 and hung.failed == timeouts >= 2
            assert (late.delivered, late.failed) == (0, 0)  # abandoned: the daemon's decision, not a failure
    finally:
        await aengine.dispose()


def test_migration_adds_the_failures_and_the_slowest_answer(blank_engine) -> None:
    engine = blank_engine
    upgrade(engine, "0015_response_excerpt")
    old_insert = text("INSERT INTO outbox_endpoint_stats (minute, tenant_id, origin, daemon_id, attempts, successes)"
                      " VALUES (:minute, 't1', 'https://b.example', 'old', 3, 1)")
    with engine.begin() as conn:
        conn.execute(old_insert, {"minute": 1})
    upgrade(engine)
    assert "outbox_endpoint_stats_endpoint_idx" in {i["name"] for i in inspect(engine).get_indexes(
        "outbox_endpoint_stats")}
    with engine.begin() as conn:
        conn.execute(old_insert, {"minute": 2})  # a daemon of the previous release, after the upgrade
        rows = conn.execute(select(endpoint_stats.c.minute, endpoint_stats.c.attempts, endpoint_stats.c.failures,
                                   endpoint_stats.c.latency_ms_max).order_by(endpoint_stats.c.minute)).all()
    assert [tuple(r) for r in rows] == [(1, 3, 0, 0), (2, 3, 0, 0)]
    with engine.begin() as conn:
        command.downgrade(alembic_config(conn), "0015_response_excerpt")
    columns = {c["name"] for c in inspect(engine).get_columns("outbox_endpoint_stats")}
    indexes = {i["name"] for i in inspect(engine).get_indexes("outbox_endpoint_stats")}
    assert "attempts" in columns and not columns & {"failures", "latency_ms_max"}
    assert "outbox_endpoint_stats_endpoint_idx" not in indexes
