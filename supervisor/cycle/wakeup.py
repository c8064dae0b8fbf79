"""LISTEN for enqueue notifications on PostgreSQL so an idle daemon wakes within ms.

A dedicated autocommit psycopg connection, outside the pool. Notifications are lost while
it reconnects, which is why the claimer also polls: this only makes the common case fast.
Behind a transaction-mode pooler a notification cannot arrive (the server connection that
ran LISTEN goes back to the pool); the daemon then listens on
``OUTBOX_LISTEN_DATABASE_URL``, a direct connection, or polls only (:func:`listen_url`,
docs/pooler.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import psycopg
import structlog

from outbox.config import Settings
from outbox.db import libpq_url
from outbox.store import CHANNEL
from supervisor.cycle.cutoff import Cutoff


def listen_url(settings: Settings) -> str | None:
    """Where LISTEN can hear a commit's NOTIFY (``None``: nowhere; the daemon polls)."""
    if settings.listen_database_url is not None:
        return settings.listen_database_url
    return settings.database_url if settings.database_pooler == "none" else None


async def listen(url: str, on_notify: Callable[[], None], channel: str = CHANNEL,
                 options: dict[str, Any] | None = None, *, cutoff: Cutoff) -> None:
    """Call ``on_notify`` for each notification on ``channel``, forever, reconnecting with back-off.

    ``options`` are libpq's connection options (timeouts and keepalives: a dead peer is
    noticed, and the connection made again). The connection counts among ``cutoff``'s: a
    stop that cuts the daemon's connections cuts this one too, rather than cancelling it.
    """
    log = structlog.get_logger("outboxd.wakeup")
    delay = 0.5
    while True:
        try:
            async with await cutoff.connect(libpq_url(url), autocommit=True, **(options or {})) as conn:
                await conn.execute(f"LISTEN {channel}")
                delay = 0.5
                on_notify()  # anything committed while we were away is picked up now
                async for _ in conn.notifies():
                    on_notify()
        except asyncio.CancelledError:
            raise
        except (psycopg.Error, OSError) as exc:
            if not cutoff.is_cut:  # after a cut, the cut's own doing
                log.warning("listen.reconnecting", error=type(exc).__name__, retry_in=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
