"""Engines configured the way the outbox needs, for the daemon, the CLI and sellers.

SQLite is shared by two processes (the seller's app and the daemon), so every SQLite
connection gets WAL, ``synchronous=FULL``, a busy timeout and ``BEGIN IMMEDIATE`` write
transactions: a reader
never blocks the writer, and two writers queue instead of failing with "database is locked"
half-way through a transaction (docs/architecture.md, "SQLite").

PostgreSQL engines prepare no statements on the server (``prepare_threshold=None``): behind
a transaction-mode pooler such as PgBouncer, consecutive transactions of one connection run
on different server connections, where psycopg's prepared statements are missing or belong
to another client (docs/pooler.md). These engines serve the CLI, ``migrate`` and the
daemon's less frequent statements, where preparing saves nothing that matters.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox.config_values import normalize_database_url

if TYPE_CHECKING:
    from outbox.config import Settings

SQLITE_BUSY_TIMEOUT_MS = 30_000


def _parsed(url: str | URL) -> URL:
    """``url`` as SQLAlchemy reads it, ``postgres://`` spelt ``postgresql://``."""
    return make_url(normalize_database_url(url) if isinstance(url, str) else url)


def _driver_url(url: str | URL, *, asynchronous: bool) -> URL:
    """Pick the driver this product is tested with, whatever the operator wrote."""
    parsed = _parsed(url)
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        return parsed.set(drivername="postgresql+psycopg")
    if backend == "sqlite":
        return parsed.set(drivername="sqlite+aiosqlite" if asynchronous else "sqlite+pysqlite")
    raise ValueError(f"unsupported database {backend!r}: use postgresql:// or sqlite:///")


def configure_sqlite(engine: Engine) -> None:
    """Give a (sync) SQLite engine WAL, a busy timeout and ``BEGIN IMMEDIATE``.

    Sellers on SQLite should call this on their own engine (or use :func:`make_engine`)
    so their enqueue transactions take the write lock up front.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # let the "begin" hook below emit BEGIN
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        # FULL: a committed enqueue or outcome survives power loss, not only a crash of
        # the process (WAL with NORMAL may lose the last transactions on power loss).
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        # Under AUTOCOMMIT nothing ever commits what this would begin: every write on the
        # connection, an enqueue included, would vanish when it closes.
        if not connection._is_autocommit_isolation():
            reads_only = connection.get_execution_options().get(READS_ONLY, False)
            connection.exec_driver_sql("BEGIN" if reads_only else "BEGIN IMMEDIATE")


READS_ONLY = "outbox_reads_only"  # the execution option :func:`reading` sets
_Engine = TypeVar("_Engine", Engine, AsyncEngine)


def reading(engine: _Engine) -> _Engine:
    """``engine`` (the same pool) for transactions that only read: on SQLite they begin
    deferred, reading a WAL snapshot, so they neither wait for a writer nor hold one up (an
    operator's ``list`` of a large table took the write lock for seconds, and a seller's
    enqueue behind it failed "database is locked"). Never for a transaction that writes: its
    read lock could not always become a write lock."""
    return engine.execution_options(**{READS_ONLY: True})


# Idle connections are probed after 10 s, every 5 s, and dropped after 3 lost probes.
_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}


def error_line(exc: BaseException) -> str:
    """The first line of a failed database call's driver error (SQLAlchemy wraps it as
    ``orig``): what the CLI and the console print in place of a traceback."""
    return str(getattr(exc, "orig", None) or exc).splitlines()[0]


def connect_options(settings: "Settings") -> dict[str, Any]:
    """libpq options (``connect_args`` of a PostgreSQL engine, ``kwargs`` of a psycopg pool)
    that bound connecting and a dead peer by ``OUTBOX_DATABASE_STATEMENT_TIMEOUT_SECONDS``.

    Without them a connection to a server that stopped answering (a failover that left the
    old address silent, a host gone) waits for the operating system: about two minutes to
    give up connecting, and hours for an answer on a connection already open (TCP keepalives
    start after two hours by default). Every PostgreSQL connection of the daemon and its
    tools carries them; so should a seller's code the daemon runs (the reporting hand-off's
    factory, docs/reporting.md).
    """
    timeout = settings.database_statement_timeout_seconds
    return {"connect_timeout": max(2, math.ceil(timeout)), **_KEEPALIVES, "tcp_user_timeout": int(timeout * 1000)}


def bound_idle_in_transaction(connection: Connection, settings: "Settings") -> None:
    """End this transaction on the server if its client goes quiet inside it for
    ``OUTBOX_DATABASE_STATEMENT_TIMEOUT_SECONDS`` (PostgreSQL; nothing on SQLite).

    A network black hole that swallows a transaction's next statement or its ``COMMIT``
    leaves the server waiting on a client that is gone, holding what the transaction locked
    (a row it inserted keeps its unique key taken, so the same message enqueued again
    waits) until its TCP keepalives give up, hours later. ``SET LOCAL``, not a startup
    option or a session ``SET``: it works behind a transaction pooler too, and ends with the
    transaction. One round trip per transaction; call it first in each one whose writer
    runs its statements back to back.
    """
    if connection.dialect.name == "postgresql":
        idle_ms = int(settings.database_statement_timeout_seconds * 1000)
        connection.exec_driver_sql(f"SET LOCAL idle_in_transaction_session_timeout = {idle_ms}")


NO_PREPARED_STATEMENTS: dict[str, Any] = {"prepare_threshold": None}  # psycopg: works behind any pooler


def _pooler_safe(driver_url: URL, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with psycopg's server-side prepared statements off on PostgreSQL (unless the
    caller's ``connect_args`` say otherwise)."""
    if driver_url.get_backend_name() == "postgresql":
        kwargs["connect_args"] = {**NO_PREPARED_STATEMENTS, **kwargs.get("connect_args", {})}
    return kwargs


def make_engine(url: str | URL, **kwargs: Any) -> Engine:
    """A synchronous engine for ``url`` (psycopg 3 on PostgreSQL, pysqlite on SQLite)."""
    driver_url = _driver_url(url, asynchronous=False)
    kwargs = _pooler_safe(driver_url, kwargs)
    engine = create_engine(driver_url, **kwargs)
    if driver_url.get_backend_name() == "sqlite":
        configure_sqlite(engine)
    return engine


def make_async_engine(url: str | URL, **kwargs: Any) -> AsyncEngine:
    """An asyncio engine for ``url`` (psycopg 3 on PostgreSQL, aiosqlite on SQLite)."""
    driver_url = _driver_url(url, asynchronous=True)
    if driver_url.get_backend_name() == "sqlite":
        kwargs.setdefault("connect_args", {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
    kwargs = _pooler_safe(driver_url, kwargs)
    engine = create_async_engine(driver_url, **kwargs)
    if driver_url.get_backend_name() == "sqlite":
        configure_sqlite(engine.sync_engine)
    return engine


def libpq_url(url: str | URL) -> str:
    """A SQLAlchemy URL (``postgresql+psycopg://…``, ``postgres://…``) as libpq and psycopg
    take it: for a psycopg connection or pool beside the engines."""
    return _parsed(url).set(drivername="postgresql").render_as_string(hide_password=False)


def is_postgresql(url: str | URL) -> bool:
    return _parsed(url).get_backend_name() == "postgresql"
