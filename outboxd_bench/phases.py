"""The timed phases: the bare loop, throughput (one origin, a shared origin, many origins,
two daemons), commit-to-arrival latency with and without a hanging tenant, and memory.

Each phase starts from an empty outbox, runs real processes, and returns its figures with
where the machine's CPU went meanwhile.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from outboxd_bench.harness import TENANTS, Bench
from outboxd_bench.procs import (POLL, CpuMeter, PhaseError, Proc, ReceiverProc, cpu_seconds, memory_mb, percentile,
                                 spawn)

DUE_FOR_RSS = 10_000
LATENCY_TAIL_TIMEOUT = 15.0  # after the last commit, wait at most this long for arrivals
TAIL_SHARE = 0.05  # "the tail": the last 5 % of a throughput run's arrivals

# message index -> (tenant number, URL): how a throughput case spreads its messages
Spread = Callable[[int], tuple[int, str]]


def phase_bare(bench: Bench, concurrency: int) -> dict[str, Any]:
    """The bare httpx loop at one concurrency, ``--messages`` POSTs, in its own process."""
    bench.truncate()
    body_file = bench.workdir / "body.json"
    body_file.write_bytes(bench.sample())
    out = bench.workdir / f"bare-{concurrency}.json"
    out.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "outboxd_bench.bare", bench.main.url("/ok"), str(bench.options.messages),
            str(concurrency), str(body_file), str(out)]
    if bench.ca_file is not None:
        argv.append(str(bench.ca_file))
    meter = CpuMeter(bench.engine, [], [bench.main.proc.pid]).start()
    proc = spawn("bare-httpx", argv, bench.workdir / "bare.log")
    try:
        proc.popen.wait(bench.options.drain_timeout)
    except subprocess.TimeoutExpired:
        raise PhaseError(f"bare loop did not finish {bench.options.messages} POSTs in "
                         f"{bench.options.drain_timeout:.0f} s") from None
    finally:
        proc.stop(signal.SIGKILL)  # nothing once it has exited; else timed out, or the bench is stopping
    if proc.popen.returncode != 0 or not out.exists():
        raise PhaseError(f"bare loop failed: {proc.log_tail()}")
    result = json.loads(out.read_text())
    result["cpu"] = meter.stop()
    return result


def one_origin(bench: Bench) -> Spread:
    url = bench.main.url("/ok")
    return lambda i: (i % TENANTS, url)


def shared_origin(bench: Bench) -> Spread:
    """Many tenants (``--shared-tenants``), one receiver origin: the shared SaaS receiver."""
    url, tenants = bench.main.url("/ok"), bench.options.shared_tenants
    return lambda i: (i % tenants, url)


def many_origins(bench: Bench) -> Spread:
    urls = [bench.many.url("/ok", k) for k in range(len(bench.many.ports))]
    return lambda i: (i % TENANTS, urls[i % len(urls)])


def phase_throughput(bench: Bench, spread: Spread, receiver: ReceiverProc, *, daemons: int = 1,
                     tag: str) -> dict[str, Any]:
    """``--messages`` messages committed at once, drained by ``daemons`` daemon(s)."""
    from sqlalchemy import text

    n = bench.options.messages
    bench.truncate()
    offset = receiver.offset()
    procs = bench.start_daemons(daemons, tag=tag)
    try:
        keys: set[str] = set()
        with bench.engine.connect() as conn:
            with conn.begin():
                for i in range(n):
                    tenant, url = spread(i)
                    keys.add(bench.enqueue(conn, i, tenant, url).idempotency_key)
                cpu0 = {p.pid: cpu_seconds(p.pid) for p in procs}
                meter = CpuMeter(bench.engine, [p.pid for p in procs], [receiver.proc.pid]).start()
            committed = conn.execute(text("SELECT extract(epoch from clock_timestamp())::float8")).scalar_one()
        _wait_drained(bench, procs, n)
        cpu = {p.pid: cpu_seconds(p.pid) - cpu0[p.pid] for p in procs}
        usage = meter.stop()
        peak = {p.name: round(memory_mb(p.pid), 1) for p in procs}
        with bench.engine.connect() as conn:
            states: dict[str, int] = dict(conn.execute(text("SELECT state, count(*) FROM outbox_messages GROUP BY state")).all())
            last = conn.execute(text("SELECT max(finished_at) FROM outbox_messages")).scalar_one()
            split = sorted(conn.execute(text("SELECT count(*) FROM outbox_attempts WHERE outcome = 'success' "
                                             "GROUP BY daemon_id")).scalars().all(), reverse=True)
    finally:
        bench.stop_daemons(procs)
    delivered = states.get("delivered", 0)
    if delivered == 0:
        raise PhaseError(f"nothing delivered: {states}")
    seconds = max(float(last) - float(committed), 1e-6)
    total_cpu = sum(cpu.values())
    arrivals = [r for r in receiver.read_from(offset) if r.get("key") in keys and r.get("status") == 200]
    return {
        "daemons": daemons, "messages": n, "delivered": delivered, "dead": states.get("dead", 0),
        "seconds": round(seconds, 3), "deliveries_per_s": round(delivered / seconds, 1),
        "cpu_s": round(total_cpu, 3), "cpu_s_per_1000": round(total_cpu / delivered * 1000, 3),
        "cpu_s_per_daemon": [round(c, 3) for c in cpu.values()],
        "peak_rss_mb": max(peak.values()), "peak_rss_mb_per_daemon": peak, "deliveries_per_daemon": split,
        "postgres_cpu_s_per_1000": round(usage["postgres_cpu_s"] / delivered * 1000, 3),
        "duplicates": len(arrivals) - len({r["key"] for r in arrivals}),
        **tail(sorted(float(r["t"]) for r in arrivals)), "cpu": usage,
    }


# Whether anything is left to send, read through the partial indexes of pending and
# in-flight rows (one entry each, ordered as the indexes are). Counting the finished rows
# instead scans the table: 10 ms at 12,000 rows, every poll, on the CPU the daemon is
# being measured on.
_LIVE = ("SELECT EXISTS (SELECT 1 FROM (SELECT id FROM outbox_messages WHERE state = 'pending'"
         " ORDER BY next_attempt_at, id LIMIT 1) AS p)"
         " OR EXISTS (SELECT 1 FROM (SELECT id FROM outbox_messages WHERE state = 'in_flight'"
         " ORDER BY lease_expires_at LIMIT 1) AS f)")


def _wait_drained(bench: Bench, procs: Sequence[Proc], n: int) -> None:
    """Until the phase's ``n`` messages (all the outbox holds) are delivered or dead."""
    from sqlalchemy import text

    deadline = time.monotonic() + bench.options.drain_timeout
    while True:
        with bench.engine.connect() as conn:
            if not conn.execute(text(_LIVE)).scalar_one():
                return
        for p in procs:
            if not p.alive():
                raise PhaseError(f"{p.name} exited with {p.popen.returncode}: {p.log_tail()}")
        if time.monotonic() > deadline:
            with bench.engine.connect() as conn:
                done = conn.execute(text("SELECT count(*) FROM outbox_messages "
                                         "WHERE state IN ('delivered', 'dead')")).scalar_one()
            raise PhaseError(f"{len(procs)} daemon(s) finished {done}/{n} in {bench.options.drain_timeout:.0f} s")
        time.sleep(POLL)


def tail(times: Sequence[float]) -> dict[str, float]:
    """The steady rate (arrivals between the 5th and 95th percentile) and the rate of the
    last 5 %: a claimer that sleeps while rows are free shows as a slow tail."""
    if len(times) < 40:
        return {"steady_rate_per_s": 0.0, "tail_rate_per_s": 0.0, "tail_ratio": 0.0, "tail_seconds": 0.0}
    n = len(times)
    lo, hi = int(n * TAIL_SHARE), int(n * (1 - TAIL_SHARE))
    steady = (hi - lo) / max(times[hi] - times[lo], 1e-6)
    rate = (n - 1 - hi) / max(times[-1] - times[hi], 1e-6)
    return {"steady_rate_per_s": round(steady, 1), "tail_rate_per_s": round(rate, 1),
            "tail_ratio": round(rate / steady, 3), "tail_seconds": round(times[-1] - times[hi], 3)}


def phase_latency(bench: Bench, *, hang: bool) -> dict[str, Any]:
    """``--rate`` messages/s for ``--duration`` s, each in its own transaction, ten tenants;
    with ``hang`` the tenth tenant's endpoint (its own origin) never answers."""
    bench.truncate()
    procs = bench.start_daemons(1, tag="hang" if hang else "latency")
    try:
        return offer_load(bench, hang=hang, daemon=procs[0])
    finally:
        bench.stop_daemons(procs)


def offer_load(bench: Bench, *, hang: bool, daemon: Proc, one_origin: bool = False) -> dict[str, Any]:
    """``--rate`` messages/s for ``--duration`` s, each committed alone; their commit-to-arrival
    latencies. The tenth tenant has its own origin unless ``one_origin``."""
    rate, duration = bench.options.rate, bench.options.duration
    count = max(1, int(rate * duration))
    receivers = (bench.main, bench.aux)
    offsets = [r.offset() for r in receivers]
    healthy_url = bench.main.url("/ok")
    tenth_url = healthy_url if one_origin else bench.aux.url("/hang" if hang else "/ok")
    commits: dict[str, tuple[float, int]] = {}
    meter = CpuMeter(bench.engine, [daemon.pid], [r.proc.pid for r in receivers]).start()
    started = time.monotonic()
    stop_at = started + duration * 1.5 + 5  # a producer that cannot keep up stops here
    with bench.engine.connect() as conn:
        for i in range(count):
            delay = started + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            elif time.monotonic() > stop_at:
                break
            tenant = i % TENANTS
            with conn.begin():  # each message in its own transaction
                message = bench.enqueue(conn, i, tenant, tenth_url if tenant == TENANTS - 1 else healthy_url)
            commits[message.idempotency_key] = (time.time(), tenant)
    produced_seconds = time.monotonic() - started
    expected = {k for k, (_, tenant) in commits.items() if not (hang and tenant == TENANTS - 1)}
    arrived: dict[str, float] = {}
    deadline = time.monotonic() + LATENCY_TAIL_TIMEOUT
    while True:
        for receiver, offset in zip(receivers, offsets):
            for row in receiver.read_from(offset):
                key = row.get("key")
                if key in commits and key not in arrived:
                    arrived[key] = float(row["t"])
        if expected <= arrived.keys() or time.monotonic() > deadline:
            break
        time.sleep(POLL * 4)
    usage = meter.stop()
    latencies = [(arrived[k] - commits[k][0]) * 1000 for k in expected if k in arrived]
    if not latencies:
        raise PhaseError("no message arrived")
    result = {
        "offered": len(commits), "offered_rate_per_s": round(len(commits) / produced_seconds, 1),
        "tenants": TENANTS, "measured_tenants": TENANTS - 1 if hang else TENANTS,
        "arrived": len(latencies), "missing": len(expected) - len(latencies),
        "p50_ms": round(percentile(latencies, 50), 2), "p95_ms": round(percentile(latencies, 95), 2),
        "p99_ms": round(percentile(latencies, 99), 2), "max_ms": round(max(latencies), 2),
        "mean_ms": round(statistics.fmean(latencies), 2),
        "daemon_cpu_s_per_1000": round(usage["daemons_cpu_s"] / len(commits) * 1000, 3),
        "cpu": usage, "daemon_peak_rss_mb": round(memory_mb(daemon.pid), 1),
    }
    if hang:  # requests that reached /hang (logged on arrival) and were never answered
        result["hanging_tenant_requests"] = sum(1 for k, (_, t) in commits.items()
                                                if t == TENANTS - 1 and k in arrived)
    return result


def phase_rss(bench: Bench) -> dict[str, Any]:
    """Peak RSS of one daemon facing 10,000 due messages for ``--duration`` s."""
    from sqlalchemy import text

    bench.truncate()
    with bench.engine.begin() as conn:
        bench.insert_due_sql(conn, DUE_FOR_RSS, bench.main.url("/ok"), "rss")
    procs = bench.start_daemons(1, tag="rss")
    daemon = procs[0]
    try:
        window_end = time.monotonic() + bench.options.duration
        rss_samples = []
        remaining = DUE_FOR_RSS
        while time.monotonic() < window_end:
            rss_samples.append(memory_mb(daemon.pid, "VmRSS"))
            with bench.engine.connect() as conn:
                remaining = conn.execute(text("SELECT count(*) FROM outbox_messages "
                                              "WHERE state IN ('pending', 'in_flight')")).scalar_one()
            if remaining == 0 or not daemon.alive():
                break
            time.sleep(0.2)
        if not daemon.alive():
            raise PhaseError(f"{daemon.name} exited: {daemon.log_tail()}")
        peak = memory_mb(daemon.pid)
    finally:
        bench.stop_daemons(procs)
    return {"due_at_start": DUE_FOR_RSS, "still_due_at_end": remaining, "window_s": bench.options.duration,
            "peak_rss_mb": round(peak, 1), "max_sampled_rss_mb": round(max(rss_samples), 1)}

