"""LISTEN for enqueue notifications on PostgreSQL so an idle daemon wakes within ms.

A dedicated autocommit psycopg connection, outside the pool. Notifications are lost while
it reconnects (and never arrive through PgBouncer in transaction mode), which is why the
claimer also polls: this only makes the common case fast.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import psycopg
import structlog

from outbox.store import CHANNEL
from supervisor.pgdirect import libpq_url


async def listen(url: str, on_notify: Callable[[], None], channel: str = CHANNEL) -> None:
    """Call ``on_notify`` for each notification on ``channel``, forever, reconnecting with back-off."""
    log = structlog.get_logger("outboxd.wakeup")
    delay = 0.5
    while True:
        try:
            async with await psycopg.AsyncConnection.connect(libpq_url(url), autocommit=True) as conn:
                await conn.execute(f"LISTEN {channel}")
                delay = 0.5
                on_notify()  # anything committed while we were away is picked up now
                async for _ in conn.notifies():
                    on_notify()
        except asyncio.CancelledError:
            raise
        except (psycopg.Error, OSError) as exc:
            log.warning("listen.reconnecting", error=type(exc).__name__, retry_in=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
