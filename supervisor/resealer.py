"""The daemon's background re-sealer: moves every stored body onto the active key.

After an operator rotates ``OUTBOX_ENCRYPTION_KEY`` (the old key moved to
``OUTBOX_ENCRYPTION_OLD_KEYS``), rows sealed under the old key, and rows a plain-SQL
producer wrote in plaintext, are re-sealed here in short batches, each its own
transaction, while delivery goes on. When nothing is left the loop only checks, every
``IDLE_SECONDS``, with an indexed query. ``outboxd encryption reseal`` runs the same
batches on demand (docs/encryption.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.bodies import reseal_batch
from outbox.sealing import SealingKeys
from supervisor.outage import OutageGuard

IDLE_SECONDS = 10.0
BATCH = 200


async def reseal_all(engine: AsyncEngine, keys: SealingKeys, *, batch: int = BATCH) -> tuple[int, list[int]]:
    """One pass over the table: re-seal what is not under the active key; (count, ids that do not open)."""
    total, failed, after = 0, [], 0
    while True:
        async with engine.begin() as conn:
            done, last, bad = await reseal_batch(conn, keys, after_id=after, limit=batch)
        total += done
        failed += bad
        if last is None:
            return total, failed
        after = last
        await asyncio.sleep(0)  # let deliveries run between batches


class Resealer:
    def __init__(self, engine: AsyncEngine, keys: SealingKeys, *, outage: OutageGuard,
                 on_resealed: Callable[[int], None] | None = None) -> None:
        self._engine = engine
        self._keys = keys
        self._outage = outage
        self._on_resealed = on_resealed
        self._log = structlog.get_logger("outboxd.resealer")

    async def run(self) -> None:
        reported: set[int] = set()
        while True:
            try:
                count, failed = await reseal_all(self._engine, self._keys)
                self._outage.ok("re-seal bodies")
            except Exception as exc:
                await self._outage.failed("re-seal bodies", exc)
                continue
            if count:
                self._log.info("bodies.resealed", count=count, key_id=self._keys.active_id)
                if self._on_resealed is not None:
                    self._on_resealed(count)
            new_failures = sorted(set(failed) - reported)
            if new_failures:
                self._log.error("bodies.unopenable", count=len(new_failures), message_ids=new_failures[:20],
                                known_key_ids=list(self._keys.ids))
                reported.update(new_failures)
            await asyncio.sleep(IDLE_SECONDS)
