"""The subscriber registry as the console shows it: every column, masked like a payload."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, inspect, select
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.schema import subscribers as registry
from supervisor.operator import ops

ROWS_SHOWN = 200


def _exists(conn: Connection) -> bool:
    return inspect(conn).has_table(registry.name)


async def subscribers(engine: AsyncEngine) -> list[dict[str, Any]] | None:
    """The registry's first rows, masked; ``None`` for a database migrated before it existed."""
    async with engine.connect() as conn:
        if not await conn.run_sync(_exists):
            return None
        rows = (await conn.execute(select(registry).order_by(registry.c.id).limit(ROWS_SHOWN))).mappings().all()
    return [ops.redact({k: (v.hex() if isinstance(v, bytes) else v) for k, v in r.items()}) for r in rows]
