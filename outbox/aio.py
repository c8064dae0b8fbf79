"""Async producer API: the same functions for ``AsyncSession`` / ``AsyncConnection``.

Each one runs the synchronous implementation on the async connection's own transaction
through SQLAlchemy's ``run_sync``, so both flavours share every validation and statement.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from outbox import activity, events, subscribers
from outbox import producer as _sync
from outbox.producer import EnqueuedMessage
from outbox.subscribers import Subscriber

AsyncConn = AsyncConnection | AsyncSession


async def enqueue_task_webhook(conn: AsyncConn, **kwargs: Any) -> EnqueuedMessage:
    """Async :func:`outbox.enqueue_task_webhook`; never commits."""
    return await conn.run_sync(lambda sync_conn: _sync.enqueue_task_webhook(sync_conn, **kwargs))


async def enqueue_delivery_report(conn: AsyncConn, **kwargs: Any) -> EnqueuedMessage:
    """Async :func:`outbox.enqueue_delivery_report`; never commits."""
    return await conn.run_sync(lambda sync_conn: _sync.enqueue_delivery_report(sync_conn, **kwargs))


async def enqueue(conn: AsyncConn, **kwargs: Any) -> EnqueuedMessage:
    """Async :func:`outbox.enqueue`; never commits."""
    return await conn.run_sync(lambda sync_conn: _sync.enqueue(sync_conn, **kwargs))


async def register_subscriber(conn: AsyncConn, **kwargs: Any) -> Subscriber:
    """Async :func:`outbox.register_subscriber`; never commits."""
    return await conn.run_sync(lambda sync_conn: subscribers.register_subscriber(sync_conn, **kwargs))


async def list_subscribers(conn: AsyncConn, **kwargs: Any) -> list[Subscriber]:
    """Async :func:`outbox.list_subscribers`."""
    return await conn.run_sync(lambda sync_conn: subscribers.list_subscribers(sync_conn, **kwargs))


async def remove_subscriber(conn: AsyncConn, **kwargs: Any) -> bool:
    """Async :func:`outbox.remove_subscriber`; never commits."""
    return await conn.run_sync(lambda sync_conn: subscribers.remove_subscriber(sync_conn, **kwargs))


async def enqueue_event(conn: AsyncConn, **kwargs: Any) -> list[EnqueuedMessage]:
    """Async :func:`outbox.enqueue_event`; never commits."""
    return await conn.run_sync(lambda sync_conn: events.enqueue_event(sync_conn, **kwargs))


async def webhook_activity(conn: AsyncConn, **kwargs: Any) -> list[dict[str, Any]]:
    """Async :func:`outbox.webhook_activity`."""
    return await conn.run_sync(lambda sync_conn: activity.webhook_activity(sync_conn, **kwargs))
