"""Async producer API: the same functions for ``AsyncSession`` / ``AsyncConnection``.

Each one runs the synchronous implementation on the async connection's own transaction
through SQLAlchemy's ``run_sync``, so both flavours share every validation and statement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from outbox import activity, events, subscribers
from outbox import producer as _sync
from outbox.producer import EnqueuedMessage
from outbox.subscribers import Subscriber

AsyncConn = AsyncConnection | AsyncSession
T = TypeVar("T")


async def _in_transaction(conn: AsyncConn, work: Callable[..., T], kwargs: dict[str, Any]) -> T:
    """``work(sync connection, **kwargs)`` in ``conn``'s transaction; an ``AsyncEngine`` or a
    driver connection is refused as the synchronous API refuses an ``Engine``."""
    if not isinstance(conn, (AsyncConnection, AsyncSession)):  # nothing to share a transaction with
        raise TypeError(f"conn must be the seller's SQLAlchemy AsyncConnection or AsyncSession, inside the "
                        f"transaction the enqueue belongs to, not {type(conn).__name__}")
    return await conn.run_sync(lambda sync_conn: work(sync_conn, **kwargs))


async def enqueue_task_webhook(conn: AsyncConn, **kwargs: Any) -> EnqueuedMessage:
    """Async :func:`outbox.enqueue_task_webhook`; never commits."""
    return await _in_transaction(conn, _sync.enqueue_task_webhook, kwargs)


async def enqueue_delivery_report(conn: AsyncConn, **kwargs: Any) -> EnqueuedMessage:
    """Async :func:`outbox.enqueue_delivery_report`; never commits."""
    return await _in_transaction(conn, _sync.enqueue_delivery_report, kwargs)


async def enqueue(conn: AsyncConn, **kwargs: Any) -> EnqueuedMessage:
    """Async :func:`outbox.enqueue`; never commits."""
    return await _in_transaction(conn, _sync.enqueue, kwargs)


async def register_subscriber(conn: AsyncConn, **kwargs: Any) -> Subscriber:
    """Async :func:`outbox.register_subscriber`; never commits."""
    return await _in_transaction(conn, subscribers.register_subscriber, kwargs)


async def list_subscribers(conn: AsyncConn, **kwargs: Any) -> list[Subscriber]:
    """Async :func:`outbox.list_subscribers`."""
    return await _in_transaction(conn, subscribers.list_subscribers, kwargs)


async def remove_subscriber(conn: AsyncConn, **kwargs: Any) -> bool:
    """Async :func:`outbox.remove_subscriber`; never commits."""
    return await _in_transaction(conn, subscribers.remove_subscriber, kwargs)


async def enqueue_event(conn: AsyncConn, **kwargs: Any) -> list[EnqueuedMessage]:
    """Async :func:`outbox.enqueue_event`; never commits."""
    return await _in_transaction(conn, events.enqueue_event, kwargs)


async def webhook_activity(conn: AsyncConn, **kwargs: Any) -> list[dict[str, Any]]:
    """Async :func:`outbox.webhook_activity`."""
    return await _in_transaction(conn, activity.webhook_activity, kwargs)
