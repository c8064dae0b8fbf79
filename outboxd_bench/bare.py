"""The bare httpx loop: the ceiling of the HTTP client the daemon uses, against the same receiver.

One ``httpx.AsyncClient`` with ``concurrency`` keep-alive connections POSTs the same
producer-rendered body ``count`` times: no database, no signing, no bookkeeping. It runs in
its own process (``python -m outboxd_bench.bare``) so its CPU is measured like a daemon's.
The bench runs it at several concurrencies (1, 8, 32 by default) and compares the daemon
with the best: httpx degrades at high concurrency on one client, so the daemon's own
concurrency would flatter the ratio.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import sys
import time
from pathlib import Path
from typing import Any

from outboxd_bench.procs import memory_mb


async def bare_loop(url: str, count: int, concurrency: int, body: bytes, ca_file: str | None) -> dict[str, Any]:
    """POST ``body`` to ``url`` ``count`` times with ``concurrency`` workers; rate and CPU."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
    headers = {"Content-Type": "application/json"}
    sent = errors = 0
    async with httpx.AsyncClient(limits=limits, timeout=10.0, trust_env=False, verify=verify) as client:
        async def worker() -> None:
            nonlocal sent, errors
            while sent < count:
                sent += 1
                try:
                    response = await client.post(url, content=body, headers=headers)
                    if response.status_code != 200:
                        errors += 1
                except httpx.HTTPError:
                    errors += 1

        cpu0, started = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu0
    ok = count - errors
    return {"requests": count, "errors": errors, "seconds": round(seconds, 3),
            "requests_per_s": round(ok / seconds, 1), "process_cpu_s": round(cpu, 3),
            "cpu_s_per_1000": round(cpu / max(ok, 1) * 1000, 3), "peak_rss_mb": round(memory_mb(os.getpid()), 1),
            "concurrency": concurrency}


def main(argv: list[str]) -> int:
    """``python -m outboxd_bench.bare URL COUNT CONCURRENCY BODY_FILE OUT_JSON [CA_FILE]`` (internal)."""
    if len(argv) not in (5, 6):
        print("usage: python -m outboxd_bench.bare URL COUNT CONCURRENCY BODY_FILE OUT_JSON [CA_FILE]",
              file=sys.stderr)
        return 2
    url, count, concurrency, body_file, out = argv[:5]
    ca_file = argv[5] if len(argv) == 6 else None
    result = asyncio.run(bare_loop(url, int(count), int(concurrency), Path(body_file).read_bytes(), ca_file))
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
