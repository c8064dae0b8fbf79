"""How much time ``enqueue_task_webhook`` adds to a committed seller transaction.

Runs against PostgreSQL (``OUTBOX_DATABASE_URL``, default the local server's ``test``
database, in a scratch schema-free database it creates and drops). Each sample is one
committed transaction: a seller ``UPDATE`` alone, then the same with one enqueue; the
report is p50/p99 of each and of the difference. Not a timed test: run it by hand::

    python scripts/bench_enqueue.py [--samples 2000] [--seal]

``--seal`` turns body encryption on (a throwaway OUTBOX_ENCRYPTION_KEY), to measure what
sealing adds.
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import time
import uuid

import psycopg
from sqlalchemy import text
from sqlalchemy.engine import make_url

import outbox
from outbox.db import libpq_url, make_engine
from outbox.migrate import upgrade

PNC = {"url": "https://buyer.example.com/hooks/adcp", "operation_id": "op_1", "token": "tok_abcdefghijklmnop"}


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--seal", action="store_true", help="seal bodies with a throwaway encryption key")
    args = parser.parse_args()
    server = os.environ.get("OUTBOX_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    name = f"outboxd_enqueue_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(libpq_url(server), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = make_url(server).set(database=name).render_as_string(hide_password=False)
    engine = make_engine(url)
    try:
        upgrade(engine)
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE media_buys (id int PRIMARY KEY, status text)"))
            conn.execute(text("INSERT INTO media_buys VALUES (1, 'pending')"))
        env = {"OUTBOX_ENCRYPTION_KEY": base64.b64encode(os.urandom(32)).decode()} if args.seal else {}
        settings = outbox.load_settings(env=env)
        plain, with_enqueue = [], []
        for i in range(args.samples * 2):
            start = time.perf_counter()
            with engine.begin() as conn:
                conn.execute(text("UPDATE media_buys SET status = :s WHERE id = 1"), {"s": f"s{i}"})
                if i % 2:
                    outbox.enqueue_task_webhook(conn, tenant_id="t", push_notification_config=PNC,
                                                task_id=f"task_{i}", task_type="create_media_buy",
                                                status="completed", result={"media_buy_id": "mb_1"},
                                                settings=settings)
            (with_enqueue if i % 2 else plain).append((time.perf_counter() - start) * 1000)
        for label, values in (("seller txn alone", plain), ("seller txn + enqueue", with_enqueue)):
            print(f"{label:22} p50 {percentile(values, 50):.3f} ms   p99 {percentile(values, 99):.3f} ms")
        print(f"{'added by enqueue':22} p50 {percentile(with_enqueue, 50) - percentile(plain, 50):.3f} ms   "
              f"p99 {percentile(with_enqueue, 99) - percentile(plain, 99):.3f} ms")
    finally:
        engine.dispose()
        with psycopg.connect(libpq_url(server), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
