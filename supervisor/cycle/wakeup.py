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
import secrets
from collections.abc import Callable
from typing import Any

import psycopg
import structlog

from outbox.config import Settings
from outbox.db import libpq_url
from outbox.store import CHANNEL
from supervisor.cycle.cutoff import Cutoff


UNHEARD_HINT = ("a NOTIFY sent from another connection never reached this LISTEN connection: it goes through a "
                "transaction pooler (where notifications are dropped); point OUTBOX_LISTEN_DATABASE_URL at "
                "PostgreSQL itself. New work is found by polling (OUTBOX_POLL_INTERVAL_SECONDS) meanwhile")
PROBE_SECONDS = 5.0  # how long a LISTEN connection has to hear its own probe


async def heard_itself(conn: psycopg.AsyncConnection[Any], url: str, channel: str,
                       options: dict[str, Any] | None, on_notify: Callable[[], None]) -> bool:
    """Whether a NOTIFY sent on ``channel`` from another connection reaches ``conn``, which
    LISTENs on it. Through a transaction pooler LISTEN succeeds, but the server connection
    that ran it goes back to the pool and its notifications are dropped: the daemon would
    wait out every poll interval without a word. A direct connection (or a session pooler,
    which keeps the server connection) hears the probe within milliseconds. Other
    notifications heard meanwhile are passed on to ``on_notify``."""
    probe = f"outboxd-probe-{secrets.token_hex(8)}"
    async with await psycopg.AsyncConnection.connect(libpq_url(url), autocommit=True, **(options or {})) as sender:
        await sender.execute("SELECT pg_notify(%s, %s)", (channel, probe))
    async for notify in conn.notifies(timeout=PROBE_SECONDS):
        if notify.payload == probe:
            return True
        on_notify()
    return False


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
                if not await heard_itself(conn, url, channel, options, on_notify):
                    log.error("listen.unheard", channel=channel, hint=UNHEARD_HINT)
                async for _ in conn.notifies():
                    on_notify()
        except asyncio.CancelledError:
            raise
        except (psycopg.Error, OSError) as exc:
            if not cutoff.is_cut:  # after a cut, the cut's own doing
                log.warning("listen.reconnecting", error=type(exc).__name__, retry_in=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
