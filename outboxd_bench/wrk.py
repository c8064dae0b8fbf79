"""The C-client baseline: ``wrk`` POSTing the producer-rendered body to the one-origin
receiver, so the daemon's rate can be read against what the wire and the receiver allow,
not only against the Python bare loop. Skipped, and said so, when ``wrk`` is not installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

from outboxd_bench.harness import Bench
from outboxd_bench.procs import CpuMeter, PhaseError

WRK_CONNECTIONS = 8
WRK_THREADS = 1  # one core for the client, as the daemon has one


def phase_wrk(bench: Bench) -> dict[str, Any]:
    """``wrk -t1 -c8 -d<--duration>s`` with a POST script, its CPU from ``getrusage`` (the meter's)."""
    binary = shutil.which("wrk")
    if binary is None:
        return {"available": False, "reason": "wrk is not installed"}
    bench.truncate()
    script = bench.workdir / "post.lua"
    body = bench.sample().decode()
    script.write_text("wrk.method = \"POST\"\nwrk.headers[\"Content-Type\"] = \"application/json\"\n"
                      f"wrk.body = [==[{body}]==]\n")
    seconds = max(int(round(bench.options.duration)), 1)
    argv = [binary, f"-t{WRK_THREADS}", f"-c{WRK_CONNECTIONS}", f"-d{seconds}s", "-s", str(script),
            bench.main.url("/ok")]
    meter = CpuMeter(bench.engine, [], [bench.main.proc.pid]).start()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60)
    usage = meter.stop()
    cpu = usage["children_cpu_s"]  # wrk, the one child that ended in the window
    rate = re.search(r"Requests/sec:\s*([\d.]+)", done.stdout)
    total = re.search(r"(\d+) requests in", done.stdout)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", done.stdout)
    if done.returncode != 0 or rate is None or total is None:
        raise PhaseError(f"wrk failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-300:]}")
    requests = int(total.group(1))
    return {"available": True, "connections": WRK_CONNECTIONS, "threads": WRK_THREADS, "seconds": seconds,
            "requests": requests, "requests_per_s": float(rate.group(1)),
            "non_2xx": int(errors.group(1)) if errors else 0,
            "cpu_ms_per_request": round(cpu / max(requests, 1) * 1000, 4),
            "receiver_cpu_ms_per_request": round(usage["receiver_cpu_s"] / max(requests, 1) * 1000, 4), "cpu": usage}
