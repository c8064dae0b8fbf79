"""The many-endpoints phase: the claim and one daemon facing a backlog spread over many
endpoints (tenant + origin), as after an outage that hit many buyers at once.

The claim is measured as the scale check measures it (``EXPLAIN (ANALYZE, BUFFERS)`` of the
daemon's very statement, in a transaction rolled back) with 10, a tenth of ``--endpoints``
and ``--endpoints`` (10,000) backlogged endpoints of five due messages each: its work must
not grow with their number (docs/performance.md, "Many backlogged endpoints"). The counts are
measured in four passes, ascending, descending, ascending, descending, so that the box
speeding up or slowing down during the phase weighs on every count alike, as the enqueue
phase interleaves its variants: with two passes, the largest count's two blocks ran back to
back, and one slow spell of the box then put its fastest time at 1.47-1.61 x the smallest
count's in two full runs where the phase alone gave 0.92-1.15 x.

One daemon then drains the first ``DRAIN_MESSAGES`` (or ``--messages``, if more) of two
backlogs of the same size: 10 endpoints with a deep backlog each, and ``--endpoints``
endpoints with five messages each, each backlog twice in the same interleaved order, and the
faster drain of each is judged. A drain of 3,000 lasts two seconds, which one pause of the
box moves: the faster of two such drains put the ratio anywhere in 0.61-1.11 in runs of the
same code, those of 10,000 in 0.83-1.13.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from outboxd_bench.harness import FEW_ENDPOINTS, Bench
from outboxd_bench.procs import POLL, CpuMeter, PhaseError
from outboxd_bench.scale import measure_claim

PER_ENDPOINT = 5  # due messages per backlogged endpoint
CLAIM_REPEATS = 15
CLAIM_PASS_PAIRS = 2  # each an ascending and a descending pass over the counts
MAX_BUFFERS_RATIO, MAX_TIME_RATIO, MIN_RATE_RATIO = 1.5, 1.5, 0.8
DRAIN_MESSAGES = 10_000  # deliveries a drain counts at least (the backlog permitting)


def endpoint_counts(many: int) -> tuple[int, ...]:
    """The backlogged endpoint counts of the phase: the baseline, a tenth of ``many``, ``many``."""
    return tuple(sorted({FEW_ENDPOINTS, max(many // 10, FEW_ENDPOINTS), many}))


def phase_endpoints(bench: Bench) -> dict[str, Any]:
    few, many = FEW_ENDPOINTS, bench.options.endpoints
    claims = _claim_cases(bench, endpoint_counts(many))
    backlog = many * PER_ENDPOINT  # rows in the table for both drains
    deep, wide = _drain_cases(bench, few, many, backlog)
    base, top = claims[str(few)], claims[str(many)]
    return {"claims": claims, "drain_few": deep, "drain_many": wide, "few": few, "many": many,
            "buffers_ratio": round(top["shared_buffers_hit"] / max(base["shared_buffers_hit"], 1), 3),
            "time_ratio": round(top["execution_ms"] / max(base["execution_ms"], 1e-6), 3),
            "rate_ratio": round(wide["deliveries_per_s"] / max(deep["deliveries_per_s"], 1e-6), 3)}


def _backlog(bench: Bench, endpoints: int, per_endpoint: int, prefix: str) -> None:
    """``endpoints`` tenants of the one-origin receiver, ``per_endpoint`` due messages each,
    committed at once and folded into the due tables as a claim would, then vacuumed."""
    from sqlalchemy import text

    with bench.engine.begin() as conn:
        bench.insert_due_sql(conn, endpoints * per_endpoint, bench.main.url("/ok"), prefix, tenants=endpoints)
    with bench.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        bench.fold_arrivals(conn)
        conn.execute(text("VACUUM (ANALYZE) outbox_messages, outbox_due_endpoints, outbox_due_origins"))


def _claim_cases(bench: Bench, counts: tuple[int, ...]) -> dict[str, dict[str, Any]]:
    """Each count's claim, from ``CLAIM_REPEATS`` samples in each of ``2 * CLAIM_PASS_PAIRS``
    passes (ascending, then descending, again): the fastest execution and client wall time,
    the median buffers."""
    samples: dict[int, tuple[list[float], list[float], list[int]]] = {n: ([], [], []) for n in counts}
    for endpoints in (*counts, *reversed(counts)) * CLAIM_PASS_PAIRS:
        bench.truncate()
        _backlog(bench, endpoints, PER_ENDPOINT, f"ep{endpoints}")
        executions, _, walls, buffers, _ = measure_claim(bench, CLAIM_REPEATS)
        for kept, taken in zip(samples[endpoints], (executions, walls, buffers)):
            kept.extend(taken)
    return {str(n): {"endpoints": n, "due_rows": n * PER_ENDPOINT, "execution_ms": round(min(executions), 3),
                     "client_wall_ms": round(min(walls), 3), "shared_buffers_hit": int(statistics.median(buffers))}
            for n, (executions, walls, buffers) in samples.items()}


def _drain_cases(bench: Bench, few: int, many: int, backlog: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each backlog drained twice (few, many, many, few): the faster drain of each, with
    both drains' rates."""
    runs: dict[int, list[dict[str, Any]]] = {few: [], many: []}
    for endpoints in (few, many, many, few):
        runs[endpoints].append(_drain_case(bench, endpoints, backlog))
    deep, wide = ({**max(cases, key=lambda c: c["deliveries_per_s"]), "rates": [c["deliveries_per_s"] for c in cases]}
                  for cases in (runs[few], runs[many]))
    return deep, wide


def _drain_case(bench: Bench, endpoints: int, backlog: int) -> dict[str, Any]:
    """One daemon, running, gets a ``backlog`` over ``endpoints`` committed at once and
    delivers ``DRAIN_MESSAGES`` (or ``--messages``, if more) of it. The rate is read from the
    rows' finish times; the CPU is what went by from the end of the commit to the last of
    them, per delivery meanwhile."""
    from sqlalchemy import text

    bench.truncate()
    procs = bench.start_daemons(1, tag=f"endpoints-{endpoints}")
    daemon = procs[0]
    # Through the partial index of finished rows: filtering the 50,000 rows by state is a
    # 20 ms scan, every poll, on the CPU the daemon is measured on.
    count = text("SELECT count(*) FROM outbox_messages WHERE finished_at IS NOT NULL AND state = 'delivered'")
    try:
        _backlog(bench, endpoints, backlog // endpoints, f"drain{endpoints}")
        meter = CpuMeter(bench.engine, [daemon.pid], [bench.main.proc.pid]).start()
        with bench.engine.connect() as conn:
            before = conn.execute(count).scalar_one()
        want = min(before + max(bench.options.messages, DRAIN_MESSAGES), backlog)
        timeout = bench.options.timeout_for(want - before)
        deadline = time.monotonic() + timeout
        while True:
            with bench.engine.connect() as conn:
                done = conn.execute(count).scalar_one()
            if done >= want:
                break
            if not daemon.alive():
                raise PhaseError(f"{daemon.name} exited: {daemon.log_tail()}")
            if time.monotonic() > deadline:
                raise PhaseError(f"one daemon delivered {done}/{want} in {timeout:.0f} s")
            time.sleep(POLL)
        usage = meter.stop()
        with bench.engine.connect() as conn:
            times = conn.execute(text("SELECT finished_at FROM outbox_messages WHERE state = 'delivered' "
                                      "ORDER BY finished_at LIMIT :n"), {"n": want}).scalars().all()
            endpoints_hit = conn.execute(text("SELECT count(DISTINCT tenant_id) FROM outbox_messages "
                                              "WHERE state = 'delivered'")).scalar_one()
    finally:
        bench.stop_daemons(procs)
    seconds = max(float(times[-1]) - float(times[0]), 1e-6)
    metered = max(done - before, 1)
    return {"endpoints": endpoints, "backlog": backlog, "delivered": len(times),
            "endpoints_delivered_to": endpoints_hit, "seconds": round(seconds, 3),
            "deliveries_per_s": round((len(times) - 1) / seconds, 1), "metered_deliveries": metered,
            "cpu_ms_per_delivery": round(usage["daemons_cpu_s"] / metered * 1000, 3),
            "postgres_cpu_ms_per_delivery": round(usage["postgres_cpu_s"] / metered * 1000, 3), "cpu": usage}


def endpoint_figures(phase: dict[str, Any]) -> dict[str, Any]:
    out = {f"claim_buffers_{n}_endpoints": c["shared_buffers_hit"] for n, c in phase["claims"].items()}
    out.update({f"claim_ms_{n}_endpoints": c["execution_ms"] for n, c in phase["claims"].items()})
    out.update({"endpoints_claim_buffers_ratio": phase["buffers_ratio"], "endpoints_claim_time_ratio":
                phase["time_ratio"], "endpoints_rate_ratio": phase["rate_ratio"],
                "endpoints_few_deliveries_per_s": phase["drain_few"]["deliveries_per_s"],
                "endpoints_many_deliveries_per_s": phase["drain_many"]["deliveries_per_s"]})
    return out


def endpoint_targets(f: dict[str, Any], phase: dict[str, Any]) -> list[tuple[str, Any, str, bool]]:
    few, many = f"{phase['few']:,}", f"{phase['many']:,}"
    return [
        (f"claim work (buffers), {many} vs {few} backlogged endpoints", f["endpoints_claim_buffers_ratio"],
         f"<= {MAX_BUFFERS_RATIO}", f["endpoints_claim_buffers_ratio"] <= MAX_BUFFERS_RATIO),
        (f"claim time, {many} vs {few} backlogged endpoints", f["endpoints_claim_time_ratio"],
         f"<= {MAX_TIME_RATIO}", f["endpoints_claim_time_ratio"] <= MAX_TIME_RATIO),
        (f"one daemon's deliveries/s, {many} vs {few} backlogged endpoints", f["endpoints_rate_ratio"],
         f">= {MIN_RATE_RATIO}", f["endpoints_rate_ratio"] >= MIN_RATE_RATIO),
    ]


def render_endpoints(phase: dict[str, Any]) -> list[str]:
    lines = [f"MANY ENDPOINTS: claim statement with {PER_ENDPOINT} due messages per backlogged endpoint "
             f"(fastest / median buffers of {CLAIM_REPEATS} in each of {2 * CLAIM_PASS_PAIRS} passes); one daemon "
             f"drains the first {phase['drain_many']['delivered']:,} of {phase['drain_many']['backlog']:,}, "
             "twice each, the faster drain shown",
             f"  {'endpoints':>12}{'exec ms':>9}{'client ms':>11}{'buffers':>9}"]
    for case in phase["claims"].values():
        lines.append(f"  {case['endpoints']:>12,}{case['execution_ms']:>9.3f}{case['client_wall_ms']:>11.3f}"
                     f"{case['shared_buffers_hit']:>9}")
    lines.append(f"  {'endpoints':>12}{'per s':>9}{'CPU ms':>11}{'PG ms':>9}{'box':>6}{'other s':>9}"
                 "  both drains, per s")
    for case in (phase["drain_few"], phase["drain_many"]):
        c = case["cpu"]
        lines.append(f"  {case['endpoints']:>12,}{case['deliveries_per_s']:>9.1f}{case['cpu_ms_per_delivery']:>11.3f}"
                     f"{case['postgres_cpu_ms_per_delivery']:>9.3f}{c['box_busy']:>6.0%}{c['other_cpu_s']:>9.2f}"
                     f"  {' / '.join(f'{rate:.1f}' for rate in case['rates'])}")
    lines += [f"  most / fewest endpoints: claim buffers {phase['buffers_ratio']:g}, "
              f"claim time {phase['time_ratio']:g}, deliveries/s {phase['rate_ratio']:g}", ""]
    return lines
