"""The scale check: the daemon's claim statement with ``--scale-rows`` finished rows in the
table vs none, by ``EXPLAIN (ANALYZE, BUFFERS)`` and timed from the client, and the daemon's
gauge sampler timed from the client in both cases.

The claim walks the partial index of pending rows per endpoint
(``outbox_messages_endpoint_due_idx``, outbox/store.py), so its cost must not grow with
history; the plan says whether it still does, the times how much. The
gauges must not grow either (they read live rows only).
"""

from __future__ import annotations

import re
import statistics
import time
import uuid
from typing import Any

from outboxd_bench.harness import Bench

DUE_INDEX = "outbox_messages_endpoint_due_idx"  # outbox/schema.py: what the claim must read
SCALE_DUE_ROWS = 1_000  # pending rows present in both cases, so the claim has work
SCALE_REPEATS = 31
SCALE_WARMUP = 3
SCALE_TIMEOUT = 900.0  # seconds for inserting the history rows (statement_timeout)


def phase_scale(bench: Bench) -> dict[str, Any]:
    """Empty, scaled, empty again: the empty figure pools both runs, so a drift in the
    machine's background load during the long insert does not masquerade as a scale effect.

    Each time is the fastest of its runs: a statement's own cost is what it takes when
    nothing else takes the CPU, and on a shared virtual machine stolen time only ever adds
    (the median gauge ratio of one build measured 0.77 x to 2.16 x from run to run). The
    work, the shared buffers the statements touch, does not depend on the machine at all:
    the targets judge it, and the times are reported beside it."""
    before = _claim_case(bench, 0)
    scaled = _claim_case(bench, bench.options.scale_rows)
    after = _claim_case(bench, 0)
    empty = dict(before)
    for key in ("execution_ms", "planning_ms", "client_wall_ms", "gauges_ms"):
        samples = before.pop(f"{key}_samples") + after.pop(f"{key}_samples")
        empty[key] = round(min(samples), 3)
        empty.pop(f"{key}_samples", None)
        scaled.pop(f"{key}_samples")
    empty["execution_ms_before_after"] = [before["execution_ms"], after["execution_ms"]]
    return {"empty": empty, "scaled": scaled,
            "time_ratio": round(scaled["execution_ms"] / max(empty["execution_ms"], 1e-6), 3),
            "gauges_ratio": round(scaled["gauges_ms"] / max(empty["gauges_ms"], 1e-6), 3),
            "buffers_ratio": round(scaled["shared_buffers_hit"] / max(empty["shared_buffers_hit"], 1), 3),
            "gauges_buffers_ratio": round(scaled["gauges_buffers_hit"] / max(empty["gauges_buffers_hit"], 1), 3)}


def _claim_case(bench: Bench, history: int) -> dict[str, Any]:
    from sqlalchemy import text

    bench.truncate()
    insert_seconds = 0.0
    with bench.engine.begin() as conn:
        conn.execute(text(f"SET LOCAL statement_timeout = '{int(SCALE_TIMEOUT)}s'"))
        if history:
            bench.progress(f"inserting {history:,} delivered rows")
            started = time.perf_counter()
            _insert_history(bench, conn, history)
            insert_seconds = time.perf_counter() - started
        bench.insert_due_sql(conn, SCALE_DUE_ROWS, bench.main.url("/ok"), "scale")
    with bench.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"SET statement_timeout = '{int(SCALE_TIMEOUT)}s'"))
        bench.fold_arrivals(conn)  # what the daemon's claims do
        conn.execute(text("VACUUM (ANALYZE) outbox_messages"))  # what autovacuum would soon do
        conn.execute(text("RESET statement_timeout"))
        size = conn.execute(text("SELECT pg_total_relation_size('outbox_messages')")).scalar_one()
    bench.checkpoint()  # write the fresh pages back now, not while the claim is being timed
    gauges = _timed_gauges(bench, SCALE_WARMUP + SCALE_REPEATS)[SCALE_WARMUP:]
    # The gauge sampler's statements on outbox_messages (the breakers' count reads its own
    # table), read in the state their times were taken in: the claim samples below roll back
    # their leases, and each leaves a dead entry in the lease index the in-flight count reads.
    gauge_buffers = sum(_hits(_explain(bench, name, {})[2]) for name in ("live_counts", "next_due", "delivery_lag"))
    executions, plannings, walls, buffers, plan = measure_claim(bench, SCALE_REPEATS)
    return {
        "history_rows": history, "due_rows": SCALE_DUE_ROWS, "limit": _claim_limit(bench),
        "execution_ms": round(min(executions), 3),
        "planning_ms": round(min(plannings), 3),
        "client_wall_ms": round(min(walls), 3),
        "execution_ms_samples": executions, "planning_ms_samples": plannings, "client_wall_ms_samples": walls,
        "shared_buffers_hit": int(statistics.median(buffers)),
        "gauges_ms": round(min(gauges), 3), "gauges_ms_samples": gauges, "gauges_buffers_hit": gauge_buffers,
        "uses_due_idx": DUE_INDEX in plan, "plan": plan,
        "insert_seconds": round(insert_seconds, 1), "table_mb": round(size / 1e6, 1),
    }


def measure_claim(bench: Bench, repeats: int) -> tuple[list[float], list[float], list[float], list[int], str]:
    """The claim ``repeats`` times after ``SCALE_WARMUP`` warm-ups: execution and planning
    times (EXPLAIN), client wall times, shared buffers, and one plan."""
    executions, plannings, walls, buffers, plan = [], [], [], [], ""
    for i in range(SCALE_WARMUP + repeats):
        execution, planning, lines = _explain(bench, "claim", _claim_params(bench))
        wall = _timed_claim(bench)
        if i >= SCALE_WARMUP:
            executions.append(execution)
            plannings.append(planning)
            walls.append(wall)
            buffers.append(_hits(lines))
            plan = plan or "\n".join(lines)
    return executions, plannings, walls, buffers, plan


def _claim_limit(bench: Bench) -> int:
    """The daemon's first claim's limit: its whole lease budget is free, within a batch."""
    from supervisor.cycle.claimer import LEASE_ROUNDS

    return min(LEASE_ROUNDS * bench.settings.concurrency, bench.settings.claim_batch)


def _claim_params(bench: Bench) -> dict[str, Any]:
    """What the daemon binds (outbox/store.py, ``claim``) with the configured settings: the
    per-origin lease budget (``LEASE_ROUNDS`` rounds of ``OUTBOX_ENDPOINT_CONCURRENCY``,
    supervisor/cycle/claimer.py) and no in-flight request already over."""
    from supervisor.cycle.claimer import LEASE_ROUNDS

    return {"limit": _claim_limit(bench), "lease": bench.settings.lease_seconds,
            "horizon": bench.settings.retry_horizon_seconds, "daemon": "bench", "token": uuid.uuid4().hex,
            "cap": LEASE_ROUNDS * bench.settings.endpoint_concurrency, "held": "{}"}


def _hits(plan_lines: list[str]) -> int:
    """Shared buffers the statement touched: its top node's count, which includes every other."""
    hits = re.search(r"shared hit=(\d+)", "\n".join(plan_lines))
    return int(hits.group(1)) if hits else 0


def _explain(bench: Bench, name: str, params: dict[str, Any]) -> tuple[float, float, list[str]]:
    """EXPLAIN (ANALYZE, BUFFERS) of one of the daemon's statements, in a transaction rolled back."""
    from sqlalchemy import text

    from outbox.store import _STATEMENTS

    daemon_sql = getattr(_STATEMENTS[True], name)  # the very statement the daemon runs, with its bind types
    statement = text("EXPLAIN (ANALYZE, BUFFERS) " + daemon_sql.text).bindparams(*daemon_sql._bindparams.values())
    with bench.engine.connect() as conn:
        with conn.begin() as txn:
            lines = [row[0] for row in conn.execute(statement, params)]
            txn.rollback()
    found = {m.group(1): float(m.group(2)) for m in
             (re.match(r"(Execution|Planning) Time: ([\d.]+) ms", ln) for ln in lines) if m}
    return found["Execution"], found.get("Planning", 0.0), lines


def _timed_gauges(bench: Bench, repeats: int) -> list[float]:
    """The daemon's own 15 s gauge sampler (supervisor/cycle/maintenance.py), timed from the client, ms."""
    import asyncio

    from outbox.db import make_async_engine
    from supervisor.cycle.maintenance import sample_gauges
    from supervisor.observe.metrics import Metrics

    async def run() -> list[float]:
        engine, metrics, times = make_async_engine(bench.settings.database_url), Metrics(), []
        try:
            for _ in range(repeats):
                started = time.perf_counter()
                await sample_gauges(engine, metrics)
                times.append((time.perf_counter() - started) * 1000)
        finally:
            await engine.dispose()
        return times

    return asyncio.run(run())


def _timed_claim(bench: Bench) -> float:
    """The claim as the daemon sends it, timed from the client (round trip included)."""
    from outbox.store import _STATEMENTS

    with bench.engine.connect() as conn:
        with conn.begin() as txn:
            started = time.perf_counter()
            conn.execute(_STATEMENTS[True].claim, _claim_params(bench)).all()
            elapsed = (time.perf_counter() - started) * 1000
            txn.rollback()
    return elapsed


def _insert_history(bench: Bench, conn: Any, rows: int) -> None:
    from sqlalchemy import text

    conn.execute(text("""
        INSERT INTO outbox_messages (tenant_id, url, origin, idempotency_key, body, body_sha256, task_id,
            task_type, task_status, state, attempts, created_at, next_attempt_at, first_attempt_at,
            retry_until, last_status, finished_at)
        SELECT 'hist-tenant-' || (g % 100), 'https://buyer-' || (g % 100) || '.example/adcp/webhooks',
               'https://buyer-' || (g % 100) || '.example', k.key, b.body, sha256(b.body),
               'task_' || g, 'create_media_buy', 'completed', 'delivered', 1, t.at, t.at, t.at,
               t.at + 86400, 200, t.at + 0.05
        FROM generate_series(1, :n) AS g,
             LATERAL (SELECT 'whk_hist_' || :run || '_' || g AS key) AS k,
             LATERAL (SELECT extract(epoch from now())::float8 - 604800 * (1 - g::float8 / :n) AS at) AS t,
             LATERAL (SELECT convert_to(json_build_object(
                 'idempotency_key', k.key, 'operation_id', 'op_' || g, 'task_id', 'task_' || g,
                 'task_type', 'create_media_buy', 'status', 'completed',
                 'result', json_build_object('media_buy_id', 'mb_' || g, 'padding', repeat('x', 400))
             )::text, 'UTF8') AS body) AS b
    """), {"n": rows, "run": bench.run_id})
