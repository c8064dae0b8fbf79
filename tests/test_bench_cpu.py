"""The bench's CPU accounting, checked with a known load: the PostgreSQL CPU of a backend that
closes before the measurement ends (a peer's pool, closing as its process exits) still counts.
"""

from __future__ import annotations

import time

import psycopg

from outbox.db import libpq_url
from outboxd_bench.procs import BACKEND_SAMPLE_SECONDS, CpuMeter, cpu_seconds


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
