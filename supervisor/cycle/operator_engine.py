"""The database engine of the operator's tools (the CLI, the console, ``outboxd migrate``), with the
bounds every PostgreSQL connection of the daemon has (:mod:`outbox.db`).

A database that accepts the connection and never answers (a stuck pooler, a black hole)
fails a command within the connect timeout rather than never: on PostgreSQL the engine
connects with :func:`outbox.db.connect_options`.

And a transaction the tool can no longer reach ends on the server: each PostgreSQL
transaction starts with :func:`outbox.db.bound_idle_in_transaction`. A black hole that
swallows a replay's ``COMMIT`` would otherwise leave the server waiting on a client that is
gone, holding the rows the replay locked (and a migration's table locks, which stop every
daemon) until its TCP keepalives give up, hours later. The tools run their statements back
to back, so no transaction of theirs waits that long on itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Engine, event
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.config import Settings
from outbox.db import bound_idle_in_transaction, connect_options, is_postgresql

__all__ = ["operator_engine"]

E = TypeVar("E", Engine, AsyncEngine)


def operator_engine(settings: Settings, make: Callable[..., E]) -> E:
    """``make(OUTBOX_DATABASE_URL, ...)`` (``outbox.db.make_engine`` or
    ``make_async_engine``) with the bounds above on PostgreSQL, as it is on SQLite."""
    if not is_postgresql(settings.database_url):
        return make(settings.database_url)
    engine = make(settings.database_url, connect_args=connect_options(settings))

    @event.listens_for(engine.sync_engine if isinstance(engine, AsyncEngine) else engine, "begin")
    def _bound_idle(connection: Any) -> None:
        bound_idle_in_transaction(connection, settings)

    return engine
