"""Async producer API: the same functions for ``AsyncSession`` / ``AsyncConnection``.

Each one runs the synchronous implementation on the async connection's own transaction
through SQLAlchemy's ``run_sync``, so both flavours share every validation and statement.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from outbox import producer as _sync
from outbox.producer import EnqueuedMessage

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
