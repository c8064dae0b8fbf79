"""The daemon's hot statements on a psycopg connection of their own (PostgreSQL only).

The claim and the common completion (the message updates and attempt rows of a batch with
no breaker or proof to write) run once per message at low rates and once per batch under
load. Through SQLAlchemy's asyncio layer each statement cost about 390 µs of the daemon's
CPU; the same statement on the driver's own connection costs about 100 µs
(docs/performance.md, "The database client"). So the claimer and the completer each keep
one :class:`DirectConnection` and run the very statements of :mod:`outbox.store` on it: the
SQL is SQLAlchemy's own rendering of them, compiled once, and the functions of
``outbox.store`` take this connection as they take an ``AsyncConnection`` (the subset of
the result interface they use is here). Everything else (breakers, proofs, maintenance,
the CLI) stays on SQLAlchemy; SQLite stays on SQLAlchemy altogether.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg import AsyncRawCursor
from psycopg.rows import namedtuple_row
from sqlalchemy.dialects.postgresql.psycopg import PGDialectAsync_psycopg
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql import ClauseElement

__all__ = ["DirectConnection", "DirectResult"]

Params = Mapping[str, Any] | Sequence[Mapping[str, Any]] | None
_PYFORMAT = re.compile(r"%\((\w+)\)s|%%")  # psycopg's named placeholders, and the escaped %
_CACHE_SIZE = 64


class DirectResult:
    """The part of SQLAlchemy's result interface ``outbox.store`` uses, over fetched rows."""

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def __iter__(self) -> Any:
        return iter(self._rows)

    def one(self) -> Any:
        if len(self._rows) != 1:
            raise psycopg.ProgrammingError(f"expected one row, got {len(self._rows)}")
        return self._rows[0]

    def scalar_one(self) -> Any:
        return self.one()[0]


def libpq_url(url: str) -> str:
    """A SQLAlchemy URL (``postgresql+psycopg://…``) as libpq takes it."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class DirectConnection:
    """One autocommit psycopg connection, opened on first use and again after a failure.

    Not for concurrent use: the claimer and the completer each have their own.
    """

    dialect = PGDialectAsync_psycopg()  # ``conn.dialect.name`` is what outbox.store asks

    def __init__(self, url: str) -> None:
        self._url = libpq_url(url)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._sql: dict[tuple[int, tuple[str, ...]], tuple[ClauseElement, str, tuple[str, ...]]] = {}

    @classmethod
    def of(cls, engine: AsyncEngine) -> "DirectConnection | None":
        """A connection to ``engine``'s database if it is PostgreSQL (``None``: keep SQLAlchemy)."""
        if engine.dialect.name != "postgresql":
            return None
        return cls(engine.url.render_as_string(hide_password=False))

    async def execute(self, statement: ClauseElement, params: Params = None) -> DirectResult:
        """Run ``statement`` (a ``text()`` or an ``insert()`` of :mod:`outbox.schema`, kept for
        reuse: its rendering is cached by identity) with ``params``, or once per mapping of a
        list of them (no rows returned then)."""
        conn = await self._connection()
        try:
            async with AsyncRawCursor(conn, row_factory=namedtuple_row) as cursor:
                if isinstance(params, Sequence):
                    if params:
                        sql, names = self._compiled(statement, params[0])
                        await cursor.executemany(sql, [tuple(row[n] for n in names) for row in params])
                    return DirectResult([], cursor.rowcount)
                sql, names = self._compiled(statement, params)
                await cursor.execute(sql, tuple(params[n] for n in names) if params else None)
                rows = await cursor.fetchall() if cursor.description is not None else []
                return DirectResult(rows, cursor.rowcount)
        except BaseException:
            if conn.closed or conn.broken:
                self._conn = None
            raise

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator["DirectConnection"]:
        """Run the block's statements in one transaction (committed unless it raises)."""
        conn = await self._connection()
        try:
            async with conn.transaction():
                yield self
        except BaseException:
            if conn.closed or conn.broken:
                self._conn = None
            raise

    async def aclose(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(self._url, autocommit=True)
        return self._conn

    def _compiled(self, statement: ClauseElement, params: Mapping[str, Any] | None) -> tuple[str, tuple[str, ...]]:
        """SQLAlchemy's rendering of ``statement`` with ``$n`` placeholders, and the parameter
        name of each ``$n``: rendered once, and never parsed again by the driver (psycopg
        re-parses ``%(name)s`` queries longer than 4 KiB, the claim among them, on every run).

        An INSERT is rendered for the columns the rows carry, as SQLAlchemy would.
        """
        keys = tuple(sorted(params)) if params else ()
        known = self._sql.get((id(statement), keys))
        if known is not None and known[0] is statement:
            return known[1], known[2]
        rendered = str(statement.compile(dialect=self.dialect, column_keys=list(keys) if keys else None))
        names: list[str] = []

        def placeholder(match: re.Match[str]) -> str:
            if match.group(1) is None:
                return "%"  # an escaped literal percent sign
            if match.group(1) not in names:
                names.append(match.group(1))
            return f"${names.index(match.group(1)) + 1}"

        sql = _PYFORMAT.sub(placeholder, rendered)
        if len(self._sql) >= _CACHE_SIZE:  # only ever a handful of statements; never grow without bound
            self._sql.clear()
        self._sql[(id(statement), keys)] = (statement, sql, tuple(names))  # the statement held: its id stays unique
        return sql, tuple(names)
