"""PostgreSQL attempt history partitioned by day: converted in place by the migration,
made ahead, dropped whole by purge without blocking delivery's inserts."""

from __future__ import annotations

import asyncio
import threading
import time

import psycopg

from outbox.db import libpq_url, make_async_engine, make_engine
from outbox.migrate import upgrade
from outbox.partitions import AHEAD_DAYS, DAY, drop_attempt_partitions, ensure_attempt_partitions

# The INSERT a daemon of the release before 0007 runs (outbox/store.py, insert_attempts).
OLD_INSERT = ("INSERT INTO outbox_attempts (message_id, tenant_id, url, attempt_number, outcome, will_retry, "
              "idempotency_key, trigger{extra}) VALUES (%s, 't', 'https://b.example/h', 1, 'success', false, "
              "'whk_k', 'scheduled'{values})")


def _partitions(conn: psycopg.Connection) -> list[str]:
    return [r[0] for r in conn.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = 'outbox_attempts'::regclass ORDER BY 1")]


def test_migration_converts_existing_history_and_old_inserts_keep_working(fresh_db: str) -> None:
    engine = make_engine(fresh_db)
    upgrade(engine, "0001")
    with psycopg.connect(libpq_url(fresh_db), autocommit=True) as conn:
        for i in range(3):
            conn.execute(OLD_INSERT.format(extra="", values=""), (i,))
    upgrade(engine)
    engine.dispose()
    with psycopg.connect(libpq_url(fresh_db), autocommit=True) as conn:
        assert conn.execute("SELECT relkind FROM pg_class WHERE relname = 'outbox_attempts'").fetchone() == ("p",)
        names = _partitions(conn)
        assert "outbox_attempts_before_0007" in names
        assert len([n for n in names if n.startswith("outbox_attempts_p")]) >= AHEAD_DAYS
        conn.execute(OLD_INSERT.format(extra="", values=""), (3,))  # an old daemon, after the upgrade
        later = time.time() + 3 * DAY
        conn.execute(OLD_INSERT.format(extra=", occurred_at", values=", %s"), (4, later))
        rows = conn.execute(
            "SELECT id, message_id, tableoid::regclass::text FROM outbox_attempts ORDER BY id").fetchall()
    assert [r[1] for r in rows] == [0, 1, 2, 3, 4]
    assert [r[0] for r in rows] == sorted({r[0] for r in rows})  # the id sequence carried on
    assert rows[0][2] == "outbox_attempts_before_0007" and rows[4][2].startswith("outbox_attempts_p")


async def test_purge_drops_old_partitions_without_blocking_inserts(fresh_db: str) -> None:
    upgrade(make_engine(fresh_db))
    today = time.time() // DAY * DAY
    with psycopg.connect(libpq_url(fresh_db), autocommit=True) as conn:
        # 30+ days on: the pre-0007 partition is gone, daily ones hold 40 and 39 days ago
        conn.execute("ALTER TABLE outbox_attempts DETACH PARTITION outbox_attempts_before_0007")
        conn.execute("DROP TABLE outbox_attempts_before_0007")
        conn.execute("SELECT outbox_ensure_attempt_partitions(14)")  # the hourly upkeep made today's
        for days in (40, 39):
            lo = today - days * DAY
            conn.execute(f"CREATE TABLE outbox_attempts_old{days} PARTITION OF outbox_attempts "
                         f"FOR VALUES FROM ({lo}) TO ({lo + DAY})")
            conn.execute(OLD_INSERT.format(extra=", occurred_at", values=", %s"), (days, lo + 60))
        conn.execute(OLD_INSERT.format(extra="", values=""), (0,))
    engine = make_async_engine(fresh_db)
    try:
        # a delivery transaction holds its insert open while the purge runs
        holder = psycopg.connect(libpq_url(fresh_db))
        holder.execute(OLD_INSERT.format(extra="", values=""), (1,))
        purge = asyncio.ensure_future(drop_attempt_partitions(engine, older_than=30 * DAY))
        await asyncio.sleep(1.0)
        blocked: list[BaseException] = []

        def insert_meanwhile() -> None:
            try:
                with psycopg.connect(libpq_url(fresh_db), autocommit=True) as other:
                    other.execute("SET lock_timeout = '2s'")
                    other.execute(OLD_INSERT.format(extra="", values=""), (2,))
            except BaseException as exc:  # noqa: BLE001 - reported by the assert below
                blocked.append(exc)

        thread = threading.Thread(target=insert_meanwhile)
        thread.start()
        await asyncio.to_thread(thread.join)
        assert blocked == []  # delivery kept inserting while the detach waited
        holder.commit()
        holder.close()
        dropped = await asyncio.wait_for(purge, 30)
        assert sorted(dropped) == ["outbox_attempts_old39", "outbox_attempts_old40"]
        assert await ensure_attempt_partitions(engine) == 0  # every coming day already exists
    finally:
        await engine.dispose()
    with psycopg.connect(libpq_url(fresh_db), autocommit=True) as conn:
        assert sorted(r[0] for r in conn.execute("SELECT message_id FROM outbox_attempts")) == [0, 1, 2]
        assert not [n for n in _partitions(conn) if "old" in n]
