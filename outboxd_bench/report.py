"""The bench's report: the machine it ran on, the headline figures, the targets of the
performance issues (docs/performance.md), and the table printed at the end."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from outboxd_bench.endpoints import endpoint_figures, endpoint_targets, render_endpoints
from outboxd_bench.enqueue import enqueue_figures, enqueue_targets, render_enqueue
from outboxd_bench.scale import DUE_INDEX, SCALE_REPEATS

NOISY_SHARE = 0.15  # above this share of the box taken by others, a phase's figures are flagged
# throughput case -> label; each is compared with the best bare-loop run
CASES = {"throughput_one_origin": "one origin, 10 tenants", "throughput_shared_origin": "shared origin",
         "throughput_many_origins": "many origins", "throughput_two_daemons": "two daemons, one origin"}
MIN_RATIO, MAX_CPU_MS, MIN_TAIL = 0.8, 0.9, 0.8
# One origin: daemon + PostgreSQL CPU per delivery against the best bare loop's CPU per request,
# and deliveries/s against a C client (wrk) at the same concurrency on the same receiver.
MAX_CPU_TO_BARE, MIN_RATIO_TO_WRK = 0.5, 0.3


def meter_readings(value: Any, path: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Every CPU meter reading in a phase's figures, however deep, by its path (a reading
    under a ``cpu`` key is named by where it sits): the recovery phase's two runs and the
    many-endpoints drains carry theirs below the top, where a top-level look missed them."""
    if not isinstance(value, dict):
        return {}
    if "other_share" in value:
        return {".".join(path[:-1] if path[-1:] == ("cpu",) else path): value}
    found: dict[str, dict[str, Any]] = {}
    for key, inner in value.items():
        found.update(meter_readings(inner, (*path, str(key))))
    return found


def noisy(phases: dict[str, Any]) -> dict[str, float]:
    """The readings where other processes took more than ``NOISY_SHARE`` of the box."""
    return {name: reading["other_share"] for name, reading in meter_readings(phases).items()
            if reading["other_share"] > NOISY_SHARE}


def machine_info(engine: Any) -> dict[str, Any]:
    """CPU, versions and PostgreSQL settings: the figures mean nothing without them."""
    from importlib.metadata import version

    from sqlalchemy import text

    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    with engine.connect() as conn:
        pg = conn.execute(text("SHOW server_version")).scalar_one()
        pg_settings = {name: conn.execute(text(f"SHOW {name}")).scalar_one()
                       for name in ("shared_buffers", "synchronous_commit", "max_connections")}
    try:
        loop = f"uvloop {version('uvloop')}"
    except Exception:
        loop = "asyncio"
    return {"nproc": len(os.sched_getaffinity(0)), "cpu_model": model, "postgresql": pg,
            "postgresql_settings": pg_settings, "python": platform.python_version(),
            "httpx": version("httpx"), "event_loop": loop,
            "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3]}


def best_bare(phases: dict[str, Any]) -> dict[str, Any]:
    """The ceiling: the best bare-loop run over every concurrency and both passes."""
    runs = [v for k, v in phases.items() if k.startswith("bare_c")]
    return max(runs, key=lambda r: r["requests_per_s"])


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers, flat, units in the names."""
    ph = report["phases"]
    bare = best_bare(ph)
    out: dict[str, Any] = {"bare_best_requests_per_s": bare["requests_per_s"],
                           "bare_best_concurrency": bare["concurrency"],
                           "bare_best_cpu_ms_per_request": bare["cpu_s_per_1000"]}
    for key in CASES:
        r, name = ph[key], key.removeprefix("throughput_")
        out[f"{name}_deliveries_per_s"] = r["deliveries_per_s"]
        out[f"{name}_cpu_ms_per_delivery"] = round(r["cpu_s_per_1000"] / max(r["daemons"], 1), 3)
        out[f"{name}_postgres_cpu_ms_per_delivery"] = r["postgres_cpu_s_per_1000"]
        out[f"{name}_ratio_to_bare"] = round(r["deliveries_per_s"] / bare["requests_per_s"], 3)
        out[f"{name}_tail_ratio"] = r["tail_ratio"]
        out[f"{name}_duplicates"] = r["duplicates"]
    out["one_origin_total_cpu_ratio_to_bare"] = round(
        (out["one_origin_cpu_ms_per_delivery"] + out["one_origin_postgres_cpu_ms_per_delivery"])
        / max(out["bare_best_cpu_ms_per_request"], 1e-6), 3)
    out["ratio_two_daemons_to_one"] = round(ph["throughput_two_daemons"]["deliveries_per_s"]
                                            / ph["throughput_one_origin"]["deliveries_per_s"], 3)
    healthy, iso, scale, rss = ph["latency_healthy"], ph["latency_isolation"], ph["scale"], ph["rss_10k_due"]
    recovery = ph["latency_recovery"]
    out.update({
        "latency_p50_ms": healthy["p50_ms"], "latency_p95_ms": healthy["p95_ms"], "latency_p99_ms": healthy["p99_ms"],
        "isolation_healthy_p99_ms": iso["p99_ms"], "isolation_p99_ratio": round(iso["p99_ms"] / healthy["p99_ms"], 3),
        "claim_ms_empty": scale["empty"]["execution_ms"], "claim_ms_scaled": scale["scaled"]["execution_ms"],
        "claim_time_ratio": scale["time_ratio"], "gauges_ms_empty": scale["empty"]["gauges_ms"],
        "gauges_ms_scaled": scale["scaled"]["gauges_ms"], "gauges_time_ratio": scale["gauges_ratio"],
        "claim_buffers_ratio": scale["buffers_ratio"], "gauges_buffers_ratio": scale["gauges_buffers_ratio"],
        "rss_mb_10k_due": rss["peak_rss_mb"],
        "recovery_p99_ms_without_job": recovery["without_job"]["p99_ms"],
        "recovery_p99_ms_with_job": recovery["with_job"]["p99_ms"], "recovery_p99_ratio": recovery["p99_ratio"],
    })
    out.update(endpoint_figures(ph["endpoints"]))
    out.update(enqueue_figures(ph["enqueue"]))
    wrk = ph.get("wrk", {})
    if wrk.get("available"):
        out["wrk_requests_per_s"] = wrk["requests_per_s"]
        out["one_origin_ratio_to_wrk"] = round(ph["throughput_one_origin"]["deliveries_per_s"]
                                               / max(wrk["requests_per_s"], 1e-6), 3)
    if "peer_adcp" in ph:
        out["peer_adcp_deliveries_per_s"] = ph["peer_adcp"]["deliveries_per_s"]
        out["ratio_one_origin_to_peer_adcp"] = round(ph["throughput_one_origin"]["deliveries_per_s"]
                                                     / max(ph["peer_adcp"]["deliveries_per_s"], 1e-6), 2)
    return out


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    f, ph, o = report["figures"], report["phases"], report["options"]
    rows: list[tuple[str, Any, str, bool]] = []
    for key, label in CASES.items():
        name = key.removeprefix("throughput_")
        if name == "two_daemons":
            continue
        rows += [(f"{label}: >= {MIN_RATIO} x the best bare loop", f[f"{name}_ratio_to_bare"], f">= {MIN_RATIO}",
                  f[f"{name}_ratio_to_bare"] >= MIN_RATIO),
                 (f"{label}: daemon CPU per delivery", f[f"{name}_cpu_ms_per_delivery"], f"<= {MAX_CPU_MS} ms",
                  f[f"{name}_cpu_ms_per_delivery"] <= MAX_CPU_MS),
                 (f"{label}: last 5 % at the steady rate", f[f"{name}_tail_ratio"], f">= {MIN_TAIL}",
                  f[f"{name}_tail_ratio"] >= MIN_TAIL)]
    rows += [
        ("two daemons deliver each message once (duplicate 200s)", f["two_daemons_duplicates"], "0",
         f["two_daemons_duplicates"] == 0),
        (f"p50 <= 5 ms at {o['rate']:g} msg/s", f["latency_p50_ms"], "<= 5 ms", f["latency_p50_ms"] <= 5),
        (f"p99 <= 25 ms at {o['rate']:g} msg/s", f["latency_p99_ms"], "<= 25 ms", f["latency_p99_ms"] <= 25),
        ("isolation: healthy p99 within 2x of all-healthy p99", f["isolation_p99_ratio"], "<= 2.0",
         f["isolation_p99_ratio"] <= 2.0),
        (f"a replay job of {o['recovery_messages']:,} at the default rate: live p99 within 2x of without",
         f["recovery_p99_ratio"], "<= 2.0", f["recovery_p99_ratio"] <= 2.0),
        (f"claim work (buffers) within +-20% with {o['scale_rows']:,} delivered rows", f["claim_buffers_ratio"],
         "0.8..1.2", 0.8 <= f["claim_buffers_ratio"] <= 1.2),
        (f"gauge work (buffers) within +-20% with {o['scale_rows']:,} delivered rows", f["gauges_buffers_ratio"],
         "0.8..1.2", 0.8 <= f["gauges_buffers_ratio"] <= 1.2),
        (f"claim plan uses {DUE_INDEX} (empty and scaled)",
         f"{ph['scale']['empty']['uses_due_idx']}/{ph['scale']['scaled']['uses_due_idx']}", "True/True",
         ph["scale"]["empty"]["uses_due_idx"] and ph["scale"]["scaled"]["uses_due_idx"]),
        ("daemon RSS <= 200 MB with 10,000 due", f["rss_mb_10k_due"], "<= 200 MB", f["rss_mb_10k_due"] <= 200),
        ("one origin: daemon + PostgreSQL CPU per delivery / the best bare loop's CPU per request",
         f["one_origin_total_cpu_ratio_to_bare"], f"<= {MAX_CPU_TO_BARE}",
         f["one_origin_total_cpu_ratio_to_bare"] <= MAX_CPU_TO_BARE),
        *([(f"one origin: >= {MIN_RATIO_TO_WRK} x wrk (C client) at the same concurrency",
            f["one_origin_ratio_to_wrk"], f">= {MIN_RATIO_TO_WRK}", f["one_origin_ratio_to_wrk"] >= MIN_RATIO_TO_WRK)]
          if "one_origin_ratio_to_wrk" in f else []),
        *endpoint_targets(f, ph["endpoints"]),
        *enqueue_targets(f),
    ]
    return [{"target": t, "value": v, "threshold": th, "pass": bool(ok)} for t, v, th, ok in rows]


def render_table(report: dict[str, Any]) -> str:
    m, o, ph, s = report["machine"], report["options"], report["phases"], report["settings"]
    lines = [
        f"outboxd bench: {m['nproc']} CPU(s) {m['cpu_model']}, PostgreSQL {m['postgresql']}, "
        f"Python {m['python']}, httpx {m['httpx']}, {m['event_loop']}",
        f"{'HTTPS (throwaway CA via OUTBOX_TLS_CA_FILE)' if o['tls'] else 'plain HTTP'}; receivers do not verify "
        "signatures (the daemon still signs every request); daemons run the configured settings: "
        f"OUTBOX_CONCURRENCY={s['concurrency']}, OUTBOX_ENDPOINT_CONCURRENCY={s['endpoint_concurrency']}, "
        f"OUTBOX_CLAIM_BATCH={s['claim_batch']}",
        "",
        f"THROUGHPUT: {o['messages']} messages committed at once, drained",
        f"  {'':26}{'per s':>8}{'x bare':>7}{'CPU ms':>7}{'PG ms':>7}{'RSS MB':>7}{'tail':>6}{'dups':>5}"
        f"{'recv CPU s':>11}{'box':>5}{'other s':>8}",
    ]
    bare = best_bare(ph) if any(k.startswith("bare_c") for k in ph) else None
    for key, label in CASES.items():
        r = ph.get(key)
        if r is None:
            continue
        c = r["cpu"]
        ratio = f"{r['deliveries_per_s'] / bare['requests_per_s']:.2f}" if bare else "-"
        lines.append(f"  {label:26}{r['deliveries_per_s']:>8.1f}{ratio:>7}{r['cpu_s_per_1000'] / r['daemons']:>7.2f}"
                     f"{r['postgres_cpu_s_per_1000']:>7.2f}{r['peak_rss_mb']:>7.1f}{r['tail_ratio']:>6.2f}"
                     f"{r['duplicates']:>5}{c['receiver_cpu_s']:>11.2f}{c['box_busy']:>5.0%}{c['other_cpu_s']:>8.2f}")
    peer = ph.get("peer_adcp")
    if peer is not None:
        lines.append(f"  {'adcp PgTaskWebhookOutbox':26}{peer['deliveries_per_s']:>8.1f}"
                     f"{peer['deliveries_per_s'] / bare['requests_per_s'] if bare else 0:>7.2f}"
                     f"{peer['cpu_s_per_1000']:>7.2f}{peer['postgres_cpu_s_per_1000']:>7.2f}")
        one = ph.get("throughput_one_origin")
        if one is not None:
            ratio = one["deliveries_per_s"] / peer["deliveries_per_s"]
            lines.append(f"  outboxd (one origin) / adcp SDK = {ratio:.1f}x "
                         "deliveries/s, both with their defaults, same receiver, same run")
    wrk = ph.get("wrk")
    if wrk is not None and wrk["available"]:
        lines.append(f"  {'wrk (C client) c=' + str(wrk['connections']):26}{wrk['requests_per_s']:>8.1f}{'':>7}"
                     f"{wrk['cpu_ms_per_request']:>7.2f}{'':>14}{'':>11}{wrk['cpu']['receiver_cpu_s']:>11.2f}"
                     f"{wrk['cpu']['box_busy']:>5.0%}{wrk['cpu']['other_cpu_s']:>8.2f}")
    elif wrk is not None:
        lines.append(f"  wrk (C client): not run, {wrk['reason']}")
    for key in sorted((k for k in ph if k.startswith("bare_c")), key=lambda k: (ph[k]["concurrency"], k)):
        r = ph[key]
        label = f"bare httpx c={r['concurrency']}{' (2nd)' if key.endswith('again') else ''}"
        lines.append(f"  {label:26}{r['requests_per_s']:>8.1f}{'':>7}{r['cpu_s_per_1000']:>7.2f}{'':>7}"
                     f"{r['peak_rss_mb']:>7.1f}{'':>11}{r['cpu']['box_busy']:>5.0%}{r['cpu']['other_cpu_s']:>8.2f}")
    lines += ["  (CPU ms: per delivery, per daemon process, or per bare request; PG ms: the PostgreSQL backends of "
              "this database per delivery; tail: rate of the last 5 % / steady rate; dups: keys answered 200 twice)",
              ""]
    lines.append(f"LATENCY commit -> arrival: {o['rate']:g} msg/s offered for {o['duration']:g} s, 10 tenants, "
                 "one transaction per message")
    lines.append(f"  {'':27}{'sent':>6}{'rate/s':>8}{'arrived':>8}{'p50 ms':>8}{'p95 ms':>8}{'p99 ms':>8}"
                 f"{'max ms':>8}{'CPU ms/msg':>11}{'box busy':>9}")
    for label, key in (("all healthy", "latency_healthy"), ("1 hangs (own origin): 9", "latency_isolation")):
        r = ph.get(key)
        if r is not None:
            lines.append(f"  {label:27}{r['offered']:>6}{r['offered_rate_per_s']:>8.1f}{r['arrived']:>8}"
                         f"{r['p50_ms']:>8.1f}{r['p95_ms']:>8.1f}{r['p99_ms']:>8.1f}{r['max_ms']:>8.1f}"
                         f"{r['daemon_cpu_s_per_1000']:>11.2f}{r['cpu']['box_busy']:>9.0%}")
    recovery = ph.get("latency_recovery")
    if recovery is not None:
        job = recovery["job"]
        for label, key in (("one origin, no job", "without_job"), ("same, replay job running", "with_job")):
            r = recovery[key]
            lines.append(f"  {label:27}{r['offered']:>6}{r['offered_rate_per_s']:>8.1f}{r['arrived']:>8}"
                         f"{r['p50_ms']:>8.1f}{r['p95_ms']:>8.1f}{r['p99_ms']:>8.1f}{r['max_ms']:>8.1f}")
        lines.append(f"  p99 with / without the job = {recovery['p99_ratio']:g} (the job: {job['messages']:,} dead "
                     f"messages at most {job['rate_per_s']:g}/s, {job['replayed_during_run']:,} replayed meanwhile)")
    lines.append("")
    scale = ph.get("scale")
    if scale is not None:
        lines.append(f"SCALE: claim statement (outbox/store.py), LIMIT {scale['empty']['limit']}, "
                     f"{scale['empty']['due_rows']} due rows, fastest of {SCALE_REPEATS}")
        lines.append(f"  {'':26}{'exec ms':>9}{'plan ms':>9}{'client ms':>11}{'buffers':>9}{'table MB':>10}"
                     f"{'gauges ms':>10}{'g.buffers':>10}  due_idx")
        for label, key in (("empty history", "empty"), (f"{o['scale_rows']:,} delivered", "scaled")):
            r = scale[key]
            lines.append(f"  {label:26}{r['execution_ms']:>9.3f}{r['planning_ms']:>9.3f}{r['client_wall_ms']:>11.3f}"
                         f"{r['shared_buffers_hit']:>9}{r['table_mb']:>10.1f}{r['gauges_ms']:>10.3f}"
                         f"{r['gauges_buffers_hit']:>10}"
                         f"  {'yes' if r['uses_due_idx'] else 'NO'}")
        lines.append(f"  scaled / empty: claim time {scale['time_ratio']:g}, gauge time {scale['gauges_ratio']:g} "
                     f"(the targets judge the buffers: this machine's speed moves the times)")
        lines.append("")
    if "enqueue" in ph:
        lines += render_enqueue(ph["enqueue"])
    if "endpoints" in ph:
        lines += render_endpoints(ph["endpoints"])
    rss = ph.get("rss_10k_due")
    if rss is not None:
        lines += [f"MEMORY: one daemon with {rss['due_at_start']:,} due: peak RSS {rss['peak_rss_mb']:.1f} MB "
                  f"({rss['still_due_at_end']:,} still due after {rss['window_s']:g} s)", ""]
    if report.get("targets"):
        lines.append("TARGETS")
        for t in report["targets"]:
            value = t["value"] if isinstance(t["value"], str) else f"{t['value']:g}"
            lines.append(f"  [{'PASS' if t['pass'] else 'FAIL'}] {t['target']}: {value} (target {t['threshold']})")
    disturbed = noisy(ph)
    if disturbed:
        lines += ["", "WARNING: other processes on this machine took CPU during: " +
                  ", ".join(f"{k} ({share:.0%} of the box)" for k, share in disturbed.items()) +
                  "; throughput and latency there are understated: rerun on a quiet machine"]
    if not report["checkpoints_between_phases"]:
        lines += ["", "WARNING: the server refused CHECKPOINT (a superuser or a member of pg_checkpoint may "
                  "run it): a phase may carry the previous one's writes; rerun as such a role"]
    for phase, error in report.get("errors", {}).items():
        lines.append(f"  [ERROR] {phase}: {error}")
    return "\n".join(lines)
