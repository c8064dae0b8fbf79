"""The bench's CPU accounting, checked with known loads: the PostgreSQL CPU of a backend that
closes before the measurement ends (a peer's pool, closing as its process exits) still counts,
and a child process's CPU inside the window is the child's, not "other".
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from outbox.db import libpq_url
from outboxd_bench.procs import BACKEND_SAMPLE_SECONDS, CpuMeter, cpu_seconds

# A child that burns CPU, says so, waits for "go", burns again and writes its whole CPU at exit.
CHILD = """
import resource, sys, time
from pathlib import Path

def burn(seconds):
    until = time.process_time() + seconds
    while time.process_time() < until:
        pass

def used():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

ready, go, out = (Path(p) for p in sys.argv[1:])
burn(0.4)
ready.write_text(str(used()))
while not go.exists():
    time.sleep(0.01)
burn(0.3)
out.write_text(str(used()))
"""


def test_cpu_meter_counts_a_backend_that_closed_before_the_end(pg_engine):
    meter = CpuMeter(pg_engine, [], []).start()
    dsn = libpq_url(pg_engine.url)
    with psycopg.connect(dsn) as conn:
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        before = cpu_seconds(pid)
        conn.execute("SELECT count(*) FROM generate_series(1, 4000000)").fetchone()
        known = cpu_seconds(pid) - before
        time.sleep(5 * BACKEND_SAMPLE_SECONDS)  # the meter has seen it at its final CPU
    time.sleep(5 * BACKEND_SAMPLE_SECONDS)  # gone from /proc and pg_stat_activity
    usage = meter.stop()
    assert known >= 0.05, known
    assert known <= usage["postgres_cpu_s"] <= known + 0.1, (known, usage)


def _child(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, Path, Path]:
    ready, go, out = tmp_path / "ready", tmp_path / "go", tmp_path / "out"
    return subprocess.Popen([sys.executable, "-c", CHILD, str(ready), str(go), str(out)]), ready, go, out


def test_a_child_started_and_ended_inside_the_window_counts_whole(pg_engine, tmp_path: Path) -> None:
    """The bare loop: its interpreter's start, imports and exit are its own CPU, not "other"."""
    meter = CpuMeter(pg_engine, [], []).start()
    child, _, go, out = _child(tmp_path)
    go.touch()
    try:
        assert child.wait(60) == 0
    finally:
        child.kill()  # nothing once it has exited
    usage = meter.stop()
    whole = float(out.read_text())
    assert whole >= 0.7, whole
    assert whole <= usage["children_cpu_s"] <= whole + 0.1, (whole, usage)


def test_a_child_alive_when_the_window_opens_counts_from_there(pg_engine, tmp_path: Path) -> None:
    """The SDK peer: metered from its "draining" mark to its exit, teardown included, and not
    the CPU it spent before the mark."""
    child, ready, go, out = _child(tmp_path)
    try:
        while not ready.exists():
            time.sleep(0.01)
        time.sleep(0.05)  # its "ready" written whole
        meter = CpuMeter(pg_engine, [], [], children=[child.pid]).start()
        go.touch()
        assert child.wait(60) == 0
        usage = meter.stop()
    finally:
        child.kill()  # nothing once it has exited; else it would wait for "go" forever
        child.wait()
    inside = float(out.read_text()) - float(ready.read_text())
    assert inside >= 0.3, inside
    assert inside <= usage["children_cpu_s"] <= inside + 0.1, (inside, usage)


async def _poll(conn: psycopg.AsyncConnection, times: int) -> float:
    """The SDK peer's progress poll ``times`` times; the CPU its backend spent on them."""
    from outboxd_bench.peer import delivered

    pid = conn.info.backend_pid
    before = cpu_seconds(pid)
    for _ in range(times):
        await delivered(conn)
    return cpu_seconds(pid) - before


def test_the_peer_progress_polls_are_left_out_as_outboxd_phases_polls_are(pg_engine) -> None:
    """The SDK peer polls its progress on a connection named as the bench's, which the meter
    leaves out as it leaves out outboxd's phases' polls; the same polls on an unnamed
    connection (the SDK's pool, where they ran before) count as the SDK's PostgreSQL CPU."""
    from outboxd_bench.peer import TABLE, progress_connection

    dsn = libpq_url(pg_engine.url)
    with psycopg.connect(dsn, autocommit=True) as conn:  # enough rows for a poll to cost CPU
        conn.execute(f"CREATE TABLE {TABLE} AS SELECT 'delivered'::text AS state FROM generate_series(1, 300000)")

    async def metered(connect: Any) -> tuple[float, float]:
        async with await connect() as conn:
            meter = CpuMeter(pg_engine, [], []).start()
            known = await _poll(conn, 20)
            return known, meter.stop()["postgres_cpu_s"]

    try:
        named = asyncio.run(metered(lambda: progress_connection(dsn)))
        unnamed = asyncio.run(metered(lambda: psycopg.AsyncConnection.connect(dsn, autocommit=True)))
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP TABLE {TABLE}")
    for known, _ in (named, unnamed):
        assert known >= 0.15, (named, unnamed)
    assert named[1] <= 0.05, named
    assert unnamed[0] - 0.05 <= unnamed[1] <= unnamed[0] + 0.1, unnamed
