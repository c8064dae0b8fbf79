"""The subscriber registry as the console shows it: every column, masked like a payload."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, MetaData, Table, inspect, select
from sqlalchemy.ext.asyncio import AsyncEngine

from supervisor import ops

SUBSCRIBERS_TABLE = "outbox_subscribers"  # added by a later migration; shown when present
ROWS_SHOWN = 200


def _reflect(conn: Connection, name: str) -> Table | None:
    return Table(name, MetaData(), autoload_with=conn) if inspect(conn).has_table(name) else None


async def subscribers(engine: AsyncEngine) -> list[dict[str, Any]] | None:
    """The registry's first rows, masked; ``None`` when the table does not exist."""
    async with engine.connect() as conn:
        table = await conn.run_sync(_reflect, SUBSCRIBERS_TABLE)
        if table is None:
            return None
        rows = (await conn.execute(select(table).order_by(table.c.id).limit(ROWS_SHOWN))).mappings().all()
    return [ops.redact({k: (v.hex() if isinstance(v, bytes) else v) for k, v in r.items()}) for r in rows]
