"""Attempt history by day on PostgreSQL: partitions made ahead, old ones dropped whole.

``outbox_attempts`` is range-partitioned on ``occurred_at`` (epoch seconds), one partition
per UTC day named ``outbox_attempts_pYYYYMMDD`` (migration ``0007_attempt_partitions``).
The migration and every daemon (:mod:`supervisor.cycle.maintenance`, hourly) keep
:data:`AHEAD_DAYS` days of partitions ready, so an insert never meets a missing day even
while daemons are down or one release behind for two weeks. ``outboxd purge`` detaches
partitions wholly older than the retention ``CONCURRENTLY`` (delivery's inserts are never
blocked) and drops them: seconds for any number of rows, where deleting row by row would
take hours and bloat the table. SQLite keeps one table and deletes rows.
"""

from __future__ import annotations

import re

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

DAY = 86_400
AHEAD_DAYS = 14
MAX_HORIZON = 604_800  # no attempt row younger than the longest retry horizon is dropped

# One statement any scheduler can also run: SELECT outbox_ensure_attempt_partitions(14).
# A day already covered (the pre-0007 table, another daemon's concurrent creation) is skipped.
ENSURE_FUNCTION = """
CREATE OR REPLACE FUNCTION outbox_ensure_attempt_partitions(days_ahead integer) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    today float8 := floor(extract(epoch from now()) / 86400) * 86400;
    lo float8;
    created integer := 0;
    name text;
BEGIN
    FOR i IN 0..days_ahead LOOP
        lo := today + i * 86400;
        name := 'outbox_attempts_p' || to_char(to_timestamp(lo) AT TIME ZONE 'UTC', 'YYYYMMDD');
        CONTINUE WHEN to_regclass(name) IS NOT NULL;
        BEGIN
            EXECUTE format('CREATE TABLE %I PARTITION OF outbox_attempts FOR VALUES FROM (%s) TO (%s)',
                           name, lo, lo + 86400);
            created := created + 1;
        EXCEPTION WHEN invalid_object_definition OR duplicate_table THEN
            NULL;  -- overlaps an existing partition, or another daemon made it just now
        END;
    END LOOP;
    RETURN created;
END $$
"""

_BOUND = re.compile(r"TO \('?([^')]+)'?\)")


async def ensure_attempt_partitions(engine: AsyncEngine, days_ahead: int = AHEAD_DAYS) -> int:
    """Create the missing daily partitions from today to ``days_ahead``; how many were made."""
    async with engine.begin() as conn:
        return int((await conn.execute(text("SELECT outbox_ensure_attempt_partitions(:days)"),
                                       {"days": days_ahead})).scalar_one())


async def drop_attempt_partitions(engine: AsyncEngine, *, older_than: float, dry_run: bool = False) -> list[str]:
    """Detach (``CONCURRENTLY``) and drop every partition whose rows are all older than
    ``older_than`` seconds and than the longest retry horizon; the dropped names (with
    ``dry_run``, the names it would drop, touching nothing).

    A detach interrupted earlier (its partition is left "detach pending") is finalized first.
    """
    dropped = []
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")  # DETACH CONCURRENTLY needs it
        rows = (await conn.execute(text("""
            SELECT c.relname, pg_get_expr(c.relpartbound, c.oid), i.inhdetachpending,
                   extract(epoch from now())::float8
            FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
            WHERE i.inhparent = 'outbox_attempts'::regclass ORDER BY c.relname
        """))).all()
        for name, bound, pending, now in rows:
            match = _BOUND.search(bound or "")
            if match is None or match.group(1) == "MAXVALUE":
                continue
            if float(match.group(1)) > now - max(older_than, MAX_HORIZON):
                continue
            if not dry_run:
                how = "FINALIZE" if pending else "CONCURRENTLY"
                await conn.execute(text(f'ALTER TABLE outbox_attempts DETACH PARTITION "{name}" {how}'))
                await conn.execute(text(f'DROP TABLE "{name}"'))
            dropped.append(name)
    return dropped
