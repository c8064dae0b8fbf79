"""How long purging a month of attempt history takes on PostgreSQL, and whether delivery waits.

Creates a scratch database (dropped at the end), migrates it, fills ``--rows`` attempt rows
spread evenly over ``--days`` daily partitions that are all older than the retention, then
runs the purge's partition step (:func:`outbox.partitions.drop_attempt_partitions`, what
``outboxd purge`` does first) while a second connection keeps inserting attempt rows the
way the daemon does, one short transaction each. It prints the purge's time, the slowest
of those inserts during it, and, for scale, how long deleting one day's rows row by row
takes (``--delete-sample``: a partition's rows deleted with ``DELETE``, as a purge without
partitions would). Not a timed test: run it by hand::

    python scripts/bench_purge.py [--rows 10000000] [--days 30]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
import uuid

import psycopg
from sqlalchemy.engine import make_url

from outbox.db import libpq_url, make_async_engine, make_engine
from outbox.migrate import upgrade
from outbox.partitions import DAY, drop_attempt_partitions

RETENTION_DAYS = 30


def fill(dsn: str, rows: int, days: int) -> float:
    """``days`` daily partitions, the newest ending RETENTION_DAYS + 8 days ago (past the
    retention and the longest horizon), holding ``rows`` rows in all; seconds taken."""
    started = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        # A database migrated today holds all earlier time in one (empty) partition: replace
        # it with the daily ones a deployment that ran for months would have.
        if conn.execute("SELECT to_regclass('outbox_attempts_before_0007')").fetchone()[0] is not None:
            conn.execute("ALTER TABLE outbox_attempts DETACH PARTITION outbox_attempts_before_0007")
            conn.execute("DROP TABLE outbox_attempts_before_0007")
            conn.execute("SELECT outbox_ensure_attempt_partitions(14)")  # today's included
        today = int(time.time() // DAY * DAY)
        first = today - (RETENTION_DAYS + 8 + days) * DAY
        for d in range(days):
            lo = first + d * DAY
            name = time.strftime("outbox_attempts_p%Y%m%d", time.gmtime(lo))
            conn.execute(f'CREATE TABLE IF NOT EXISTS "{name}" PARTITION OF outbox_attempts '
                         f"FOR VALUES FROM ({lo}) TO ({lo + DAY})")
        conn.execute("""
            INSERT INTO outbox_attempts (message_id, tenant_id, url, attempt_number, outcome, http_status,
                will_retry, payload_size, idempotency_key, trigger, daemon_id, occurred_at)
            SELECT g, 'tenant-' || (g %% 100), 'https://buyer-' || (g %% 100) || '.example/hooks', 1, 'success',
                   200, false, 600, 'whk_purge_' || g, 'scheduled', 'bench',
                   %(first)s + (g::float8 / %(rows)s) * %(span)s
            FROM generate_series(0, %(rows)s - 1) AS g
        """, {"first": first, "rows": rows, "span": days * DAY - 1})
        conn.execute("ANALYZE outbox_attempts")
    return time.perf_counter() - started


def insert_while(dsn: str, stop: threading.Event, latencies: list[float]) -> None:
    """The daemon's attempt inserts, one transaction each, timed, until ``stop``."""
    with psycopg.connect(dsn) as conn:
        while not stop.is_set():
            began = time.perf_counter()
            with conn.transaction():
                conn.execute("INSERT INTO outbox_attempts (message_id, tenant_id, url, attempt_number, outcome, "
                             "will_retry, idempotency_key, trigger) VALUES (1, 't', 'https://b.example/h', 1, "
                             "'success', false, 'whk_live', 'scheduled')")
            latencies.append(time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--server", default=os.environ.get("OUTBOX_BENCH_SERVER",
                                                           "postgresql://postgres@127.0.0.1:5432/postgres"))
    args = parser.parse_args()
    name = f"outboxd_purge_{uuid.uuid4().hex[:8]}"
    server = libpq_url(args.server)
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_url(args.server).set(drivername="postgresql+psycopg", database=name).render_as_string(
        hide_password=False)
    try:
        upgrade(make_engine(url))
        dsn = libpq_url(url)
        filled = fill(dsn, args.rows, args.days)
        with psycopg.connect(dsn) as conn:
            size = conn.execute("SELECT sum(pg_total_relation_size(inhrelid)) FROM pg_inherits "
                                "WHERE inhparent = 'outbox_attempts'::regclass").fetchone()[0]
            sample = conn.execute("SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = "
                                  "'outbox_attempts'::regclass ORDER BY 1 LIMIT 1").fetchone()[0]
        print(f"{args.rows:,} attempt rows in {args.days} day partitions older than the retention "
              f"({float(size) / 1e9:.1f} GB), filled in {filled:.0f} s")

        with psycopg.connect(dsn, autocommit=True) as conn:  # the row-by-row alternative, on one day
            began = time.perf_counter()
            deleted = conn.execute(f'DELETE FROM "{sample}"').rowcount
            one_day = time.perf_counter() - began
        print(f"row by row: DELETE of one day's {deleted:,} rows took {one_day:.2f} s "
              f"(x {args.days} days: about {one_day * args.days:.0f} s, before vacuuming the dead rows)")

        stop, latencies = threading.Event(), []
        inserter = threading.Thread(target=insert_while, args=(dsn, stop, latencies))
        inserter.start()
        time.sleep(1.0)
        before = len(latencies)
        engine = make_async_engine(url)
        began = time.perf_counter()
        dropped = asyncio.run(drop_attempt_partitions(engine, older_than=RETENTION_DAYS * DAY))
        purge = time.perf_counter() - began
        during = latencies[before:]
        time.sleep(0.5)
        stop.set()
        inserter.join()
        asyncio.run(engine.dispose())
        print(f"by partition: {len(dropped)} partitions detached and dropped in {purge:.2f} s; "
              f"{len(during):,} attempt inserts meanwhile, the slowest {max(during, default=0) * 1000:.1f} ms")
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
