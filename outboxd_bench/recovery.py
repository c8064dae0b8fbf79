"""The recovery phase: live traffic's latency with and without a recovery job running.

A recovery job must not crowd out live traffic (docs/observability.md, "Recovery jobs"):
one daemon takes live traffic at ``--rate`` to one origin, first alone, then while it runs
a replay job of ``--recovery-messages`` dead messages (another tenant, another origin) at
the jobs' default rate, the way an operator starts one with ``outboxd recover start``.
The two p99s come from the same daemon in the same run, side by side.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from outboxd_bench.harness import Bench
from outboxd_bench.phases import offer_load
from outboxd_bench.procs import PhaseError

RECOVERY_TENANT = "bench-recovery"
DEAD_AGO_SECONDS = 60.0  # the recovered messages ended dead this long before the job starts


def _dead_messages(bench: Bench, count: int) -> None:
    """``count`` messages of the recovery tenant that ended dead (``gone``) a minute ago."""
    from sqlalchemy import text

    with bench.engine.begin() as conn:
        bench.insert_due_sql(conn, count, bench.many.url("/ok", 0), "recover")
        conn.execute(text("UPDATE outbox_messages SET tenant_id = :tenant, state = 'dead', dead_reason = 'gone', "
                          "attempts = 1, finished_at = extract(epoch from now()) - :ago"),
                     {"tenant": RECOVERY_TENANT, "ago": DEAD_AGO_SECONDS})


async def _start_job(database_url: str) -> int:
    """Start the replay job as ``outboxd recover start`` does, at the default rate."""
    from outbox.db import make_async_engine
    from supervisor.operator import jobs

    engine = make_async_engine(database_url)
    try:
        async with engine.begin() as conn:
            since = time.time() - 2 * DEAD_AGO_SECONDS - 3600
            job = await jobs.create(conn, jobs.Selection(RECOVERY_TENANT, since), force=False,
                                    rate=float(jobs.DEFAULT_RATE))
    finally:
        await engine.dispose()
    return int(job["id"])


def _job_row(bench: Bench, job_id: int) -> dict[str, Any]:
    from sqlalchemy import text

    with bench.engine.connect() as conn:
        return dict(conn.execute(text("SELECT state, total, done, skipped, rate FROM outbox_jobs WHERE id = :id"),
                                 {"id": job_id}).one()._mapping)


def phase_recovery(bench: Bench) -> dict[str, Any]:
    """Live p99 alone, then with a replay job of ``--recovery-messages`` running; their ratio."""
    count = bench.options.recovery_messages
    bench.truncate()
    _dead_messages(bench, count)
    procs = bench.start_daemons(1, tag="recovery")
    try:
        alone = offer_load(bench, hang=False, daemon=procs[0], one_origin=True)
        job_id = asyncio.run(_start_job(bench.settings.database_url))
        at_start = _job_row(bench, job_id)
        during = offer_load(bench, hang=False, daemon=procs[0], one_origin=True)
        at_end = _job_row(bench, job_id)
    finally:
        bench.stop_daemons(procs)
    if at_start["total"] != count:
        raise PhaseError(f"the replay job selected {at_start['total']} of {count} dead messages")
    if at_end["done"] == 0:
        raise PhaseError("the replay job replayed nothing while live traffic ran: no daemon ran it")
    # the meter's reading too: the noise warning judges each run by it
    keep = ("offered", "offered_rate_per_s", "arrived", "missing", "p50_ms", "p95_ms", "p99_ms", "max_ms", "cpu")
    return {
        "without_job": {k: alone[k] for k in keep}, "with_job": {k: during[k] for k in keep},
        "job": {"messages": count, "rate_per_s": at_end["rate"], "replayed_during_run": at_end["done"],
                "state_at_end": at_end["state"]},
        "p99_ratio": round(during["p99_ms"] / max(alone["p99_ms"], 1e-6), 3),
    }
