"""The daemon and the database's schema: wait for ``outboxd migrate`` at start, stop once the
database has moved past what this release reads.

Both compare the database's recorded revisions with this release's
(:func:`outbox.migrate.check_schema`; docs/operations.md, "Upgrading").
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.errors import ConfigurationError
from outbox.migrate import SchemaCheck, check_schema
from supervisor.cycle.cutoff import Cutoff, severed_after
from supervisor.cycle.outage import OutageGuard, unless_stopped

SCHEMA_POLL_SECONDS = 5.0
SCHEMA_LOG_SECONDS = 60.0


async def schema_check(engine: AsyncEngine, within: float | None = None) -> SchemaCheck:
    """The database's schema against this release's; on PostgreSQL, ``within`` seconds cut the
    check's connection (:func:`severed_after`), so a database that does not answer fails it then,
    where cancelling it would have psycopg ask the unreachable server to cancel (10 s)."""
    async with engine.connect() as conn:
        bound: AbstractContextManager[object] = nullcontext()
        if within is not None and engine.dialect.name == "postgresql":
            raw = (await conn.get_raw_connection()).driver_connection
            assert raw is not None  # a checked-out connection has its driver's
            bound = severed_after(raw, within)
        with bound:
            return await conn.run_sync(check_schema)


async def wait_for_schema(engine: AsyncEngine, stop: asyncio.Event, *, outage: OutageGuard, cutoff: Cutoff,
                          log: Any) -> bool:
    """Wait while the database is behind this release (``outboxd migrate`` has not run yet).

    Returns ``False`` if asked to stop meanwhile. A database ahead of this release is fine
    when its recorded minimum reader revision is ours or older (a rolling upgrade); one
    too new is refused, because waiting cannot help. A database down at start is ridden out
    like any outage (counted by ``outage``, which ends the wait past its bound).
    """
    logged_at = -SCHEMA_LOG_SECONDS
    loop = asyncio.get_running_loop()
    while True:
        try:
            check = await unless_stopped(stop, schema_check(engine), cutoff)
        except Exception as exc:
            await unless_stopped(stop, outage.failed("check the schema", exc), cutoff)
            if stop.is_set():
                return False
            continue
        if check is None:
            return False
        outage.ok("check the schema")
        if check.verdict == "incompatible":
            raise ConfigurationError(check.problem() or "")
        if check.usable:
            if check.verdict == "ahead":
                log.info("schema.ahead", database=check.database, code=check.code)
            return True
        if loop.time() - logged_at >= SCHEMA_LOG_SECONDS:
            log.warning("schema.waiting", database=check.database, code=check.code, detail=check.problem())
            logged_at = loop.time()
        try:
            await asyncio.wait_for(stop.wait(), SCHEMA_POLL_SECONDS)
            return False
        except asyncio.TimeoutError:
            pass


async def watch_schema(engine: AsyncEngine, *, within: float, log: Any) -> None:
    """Stop once the database has moved past what this release can read (a migration that
    breaks older readers ran while it delivered), with the line a start would refuse with:
    writing rows a newer schema reads otherwise is what the compatibility record forbids.
    A check that fails (``within`` seconds bound each) is an outage the other loops count:
    it is simply tried again."""
    while True:
        await asyncio.sleep(SCHEMA_POLL_SECONDS)
        try:
            check = await schema_check(engine, within)
        except Exception:
            continue
        if check.verdict == "incompatible":
            log.error("schema.incompatible", database=check.database, code=check.code)
            raise ConfigurationError(check.problem() or "")
