"""The database engine of the operator's tools (the CLI, the console, ``outboxd migrate``), kept beside
the daemon's connection settings it shares (:mod:`supervisor.cycle.pgdirect`).

A database that accepts the connection and never answers (a stuck pooler, a black hole)
fails a command within the connect timeout rather than never: on PostgreSQL the engine
connects with :func:`outbox.db.connect_options`.

And a transaction the tool can no longer reach ends on the server: each PostgreSQL
transaction starts with ``SET LOCAL idle_in_transaction_session_timeout`` of
``OUTBOX_DATABASE_STATEMENT_TIMEOUT_SECONDS``. A black hole that swallows a replay's
``COMMIT`` would otherwise leave the server waiting on a client that is gone, holding the
rows the replay locked (and a migration's table locks, which stop every daemon) until its
TCP keepalives give up, hours later. ``SET LOCAL`` (not a startup option, not a session
``SET``) because it works behind a transaction pooler too, whether or not the tool was told
of it, and ends with the transaction. The tools run their statements back to back, so no
transaction of theirs waits that long on itself. One round trip per transaction is its cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Engine, event
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.config import Settings
from outbox.db import connect_options, is_postgresql

__all__ = ["operator_engine"]

E = TypeVar("E", Engine, AsyncEngine)


def operator_engine(settings: Settings, make: Callable[..., E]) -> E:
    """``make(OUTBOX_DATABASE_URL, ...)`` (``outbox.db.make_engine`` or
    ``make_async_engine``) with the bounds above on PostgreSQL, as it is on SQLite."""
    if not is_postgresql(settings.database_url):
        return make(settings.database_url)
    engine = make(settings.database_url, connect_args=connect_options(settings))
    idle_ms = int(settings.database_statement_timeout_seconds * 1000)

    @event.listens_for(engine.sync_engine if isinstance(engine, AsyncEngine) else engine, "begin")
    def _bound_idle(connection: Any) -> None:
        connection.exec_driver_sql(f"SET LOCAL idle_in_transaction_session_timeout = {idle_ms}")

    return engine
