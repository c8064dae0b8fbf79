"""``--peer adcp``: the ``adcp`` SDK's ``PgTaskWebhookOutbox`` with its defaults, against the
same receiver in the same run, so the ratio printed beside outboxd's figures is measured,
not remembered.

It runs in its own process (``python -m outboxd_bench.peer``), in the bench database, in
the SDK's own table (dropped afterwards): ``--messages`` terminal task webhooks enqueued in
one transaction with ``enqueue_terminal``, then one ``run_worker()`` with its defaults
drains them. Two things are changed, both outside the measured path: the SDK refuses
private destinations, so after construction its sender is allowed the loopback receiver;
and it trusts the bench's throwaway CA through ``SSL_CERT_FILE`` (httpx honours it).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

TABLE = "adcp_task_webhook_outbox"
SDK_MODULE = "adcp.decisioning.pg.task_webhook_outbox"  # what the peer and the enqueue phase use


def require_sdk() -> None:
    """Import the SDK before any phase runs: without it the peer's phase failed last, in its
    own process, and a run with that error judges no targets at all."""
    from importlib import import_module

    from outboxd_bench.procs import BenchUsageError

    try:
        import_module(SDK_MODULE)
    except ImportError as exc:
        raise BenchUsageError(f"--peer adcp needs the adcp SDK, which the [test] extra installs "
                              f"(pip install 'outboxd[test]'): {exc}") from None


def phase_peer(bench: Any) -> dict[str, Any]:
    """Run the SDK's outbox over ``--messages`` in its own process; PostgreSQL CPU from /proc."""
    from outboxd_bench.procs import CpuMeter, PhaseError, spawn, wait_for
    from outbox.db import libpq_url

    n = bench.options.messages
    timeout = 30.0 + n / 10.0  # the SDK drains one at a time: allow >= 10/s
    dsn = libpq_url(bench.settings.database_url)
    out, ready = bench.workdir / "peer.json", bench.workdir / "peer.json.draining"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    if bench.ca_file is not None:
        env["SSL_CERT_FILE"] = str(bench.ca_file)
    bench.truncate()
    proc = spawn("peer-adcp", [sys.executable, "-m", "outboxd_bench.peer", dsn, bench.main.url("/ok"), str(n),
                               str(timeout), str(out)], bench.workdir / "peer.log", env)
    try:
        wait_for("adcp peer enqueue", ready.exists, 300.0, proc)  # importing adcp takes long on a busy box
        meter = CpuMeter(bench.engine, [], [bench.main.proc.pid], children=[proc.pid]).start()
        proc.popen.wait(timeout + 30)
    finally:
        proc.stop()  # nothing once it has exited; else it failed, timed out, or the bench is stopping
    if proc.popen.returncode != 0 or not out.exists():
        raise PhaseError(f"adcp peer failed: {proc.log_tail()}")
    result = json.loads(out.read_text())
    result["cpu"] = meter.stop()
    result["postgres_cpu_s_per_1000"] = round(result["cpu"]["postgres_cpu_s"] / max(result["delivered"], 1) * 1000, 3)
    if result["delivered"] < n:
        raise PhaseError(f"adcp peer delivered {result['delivered']}/{n} in {timeout:.0f} s")
    return result


async def progress_connection(dsn: str) -> Any:
    """The connection the peer's progress is polled on, apart from the SDK's pool and named as
    the bench's own, so the meter leaves its polls out as it leaves out those of outboxd's
    phases: on the pool's unnamed connections they counted as the SDK's PostgreSQL CPU."""
    import psycopg

    from outboxd_bench.procs import BENCH_APPLICATION

    return await psycopg.AsyncConnection.connect(dsn, autocommit=True, application_name=BENCH_APPLICATION)


async def delivered(conn: Any) -> int:
    """How many of the SDK's webhooks are delivered."""
    row = await (await conn.execute(f"SELECT count(*) FROM {TABLE} WHERE state = 'delivered'")).fetchone()
    return int(row[0]) if row else 0


async def drain(dsn: str, url: str, count: int, timeout: float, ready: Path) -> dict[str, Any]:
    """Enqueue ``count`` webhooks, run the SDK's worker until all are delivered; rate and CPU."""
    from adcp.decisioning.pg.task_webhook_outbox import PgTaskWebhookOutbox
    from adcp.webhook_sender import WebhookSender
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from psycopg_pool import AsyncConnectionPool

    sender = WebhookSender(private_key=ed25519.Ed25519PrivateKey.generate(), key_id="bench-peer", alg="ed25519")
    async with AsyncConnectionPool(dsn, open=False) as pool:
        outbox = PgTaskWebhookOutbox(pool=pool, sender=sender, encryption_key=os.urandom(32),
                                     delivery_retry_horizon_seconds=86_400)
        sender._allow_private_destinations = True  # the receiver is on 127.0.0.1 (see the docstring)
        async with pool.connection() as conn:
            await conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
        await outbox.create_schema()
        async with pool.connection() as conn:
            async with conn.transaction():
                for i in range(count):
                    await outbox.enqueue_terminal(
                        conn, task_id=f"peer_task_{i}", account_id=f"bench-tenant-{i % 10}",
                        task_type="create_media_buy", status="completed", url=url, operation_id=f"op_{i}",
                        token="bench-token-0123456789abcdef",
                        result={"media_buy_id": f"mb_{i}", "status": "active"})
        async with await progress_connection(dsn) as progress:
            ready.touch()
            cpu0, started = time.process_time(), time.perf_counter()
            worker = asyncio.create_task(outbox.run_worker())
            done = 0
            try:
                while time.perf_counter() - started < timeout:
                    done = await delivered(progress)
                    if done >= count:
                        break
                    await asyncio.sleep(0.05)
                seconds, cpu = time.perf_counter() - started, time.process_time() - cpu0
            finally:
                worker.cancel()
                await asyncio.gather(worker, return_exceptions=True)
                await progress.execute(f"DROP TABLE IF EXISTS {TABLE}")
    return {"messages": count, "delivered": done, "seconds": round(seconds, 3),
            "deliveries_per_s": round(done / seconds, 1), "process_cpu_s": round(cpu, 3),
            "cpu_s_per_1000": round(cpu / max(done, 1) * 1000, 3)}


def main(argv: list[str]) -> int:
    """``python -m outboxd_bench.peer DSN URL COUNT TIMEOUT OUT_JSON`` (internal)."""
    if len(argv) != 5:
        print("usage: python -m outboxd_bench.peer DSN URL COUNT TIMEOUT OUT_JSON", file=sys.stderr)
        return 2
    dsn, url, count, timeout, out = argv
    result = asyncio.run(drain(dsn, url, int(count), float(timeout), Path(out + ".draining")))
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
