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

Every connection the daemon opens to PostgreSQL (these, the engine's, LISTEN's) has a
connect timeout, TCP keepalives and a TCP user timeout (:func:`outbox.db.connect_options`), and each
statement here a deadline of ``OUTBOX_DATABASE_STATEMENT_TIMEOUT_SECONDS``, kept by the
client: an unreachable database (a network black hole, a stuck pooler) fails the statement
and the outage guard counts it, where it would otherwise hang a claim or a flush for ever.
The deadline is the client's because a transaction pooler refuses the ``options`` startup
parameter and forbids ``SET`` between transactions. Behind a transaction pooler
(``OUTBOX_DATABASE_POOLER=transaction``) these connections prepare no statements either
(docs/pooler.md). Without the setting every new connection sends a server-side timeout as a
startup option and reads it back (:func:`check_startup_options`): a pooler that dropped
the option is named at once, before a prepared statement can run on the wrong connection.
"""

from __future__ import annotations

import asyncio
import functools
import re
import secrets
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import psycopg
from psycopg import AsyncRawCursor
from psycopg.rows import namedtuple_row
from sqlalchemy import event
from sqlalchemy.dialects.postgresql.psycopg import PGDialectAsync_psycopg
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql import ClauseElement

from outbox.config import Settings
from outbox.db import connect_options, libpq_url
from supervisor.cycle.cutoff import Cutoff, severed_after

__all__ = ["DirectConnection", "DirectResult", "StartupOptionsIgnored", "check_each_connection",
           "check_startup_options", "startup_options"]

Params = Mapping[str, Any] | Sequence[Mapping[str, Any]] | None
_PYFORMAT = re.compile(r"%\((\w+)\)s|%%")  # psycopg's named placeholders, and the escaped %
_CACHE_SIZE = 64


class StartupOptionsIgnored(Exception):
    """A connection came up without the startup options it sent: something between the
    daemon and PostgreSQL dropped them (a pooler's ``ignore_startup_parameters``), so this is
    a pooled connection the daemon was not told about (docs/pooler.md)."""


# What a connection without a pooler reads back of its ``options``: a setting of outboxd's
# own, holding a value drawn at random by this process, which no server default, database
# setting or other client can have given the connection (a server whose statement_timeout
# happened to equal the daemon's would pass a check of that timeout without the options).
STARTUP_CHECK_SETTING = "outboxd.startup_check"
STARTUP_CHECK = f"SELECT current_setting('{STARTUP_CHECK_SETTING}', true)"
_STARTUP_NONCE = secrets.token_hex(8)


def startup_options(settings: Settings) -> dict[str, Any]:
    """The ``options`` startup parameter of a connection straight to PostgreSQL: a server-side
    statement timeout of the outage deadline (a statement that long is an outage), and an
    idle-in-transaction timeout of the statement timeout. The daemon never leaves a
    transaction waiting on itself between statements; one left waiting that long has lost its
    client to a black hole or a crash, and ending it frees the rows it locked (messages
    being recorded as delivered) before their leases end, where the server would otherwise
    keep them locked until its TCP keepalives give up, hours later. None behind a transaction
    pooler, which refuses or drops the parameter (its ``query_timeout`` and
    ``idle_transaction_timeout`` serve)."""
    if settings.database_pooler != "none":
        return {}
    idle_ms = int(settings.database_statement_timeout_seconds * 1000)
    return {"options": f"-c statement_timeout={_timeout_ms(settings)} -c idle_in_transaction_session_timeout={idle_ms}"
                       f" -c {STARTUP_CHECK_SETTING}={_STARTUP_NONCE}"}


def check_startup_options(setting: str | None) -> None:
    """Raise :class:`StartupOptionsIgnored` unless ``setting``, what :data:`STARTUP_CHECK`
    read on a new connection, is the value :func:`startup_options` sent. Checked on every
    new connection: a pooler that drops the options would otherwise go unnoticed until two
    of the daemon's prepared statements met on the wrong server connection, which identical
    daemons may not do for a long while."""
    if setting != _STARTUP_NONCE:
        raise StartupOptionsIgnored(f"{STARTUP_CHECK_SETTING} is {setting or 'unset'}: the connection's startup "
                                    "options (its statement timeouts among them) did not reach PostgreSQL")


def check_each_connection(engine: AsyncEngine, settings: Settings) -> None:
    """Run :func:`check_startup_options` on each connection ``engine`` opens, before its use
    (when :func:`startup_options` sends any)."""
    if not startup_options(settings):
        return

    @event.listens_for(engine.sync_engine, "connect")
    def _check(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(STARTUP_CHECK)
            row = cursor.fetchone()
        finally:
            cursor.close()
            # The check's transaction ends here: a connection handed out "in transaction"
            # cannot be switched to autocommit (the due tables' vacuum needs it).
            dbapi_connection.rollback()
        check_startup_options(row[0] if row else None)


def _timeout_ms(settings: Settings) -> int:
    return int(settings.database_outage_seconds * 1000)


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


async def _result(cursor: AsyncRawCursor[Any]) -> DirectResult:
    """The rows of the cursor's last statement (none for one that returns none)."""
    rows = await cursor.fetchall() if cursor.description is not None else []
    return DirectResult(rows, cursor.rowcount)


@functools.lru_cache(maxsize=_CACHE_SIZE)  # the few statements' rendered SQL: each judged once
def _gives_nothing_back(sql: str) -> bool:
    """Whether a statement returns nothing its caller reads: an INSERT without RETURNING."""
    head = sql.lstrip()[:6].upper()
    return head == "INSERT" and "RETURNING" not in sql.upper()


class DirectConnection:
    """One autocommit psycopg connection, opened on first use and again after a failure.

    Not for concurrent use: the claimer and the completer each have their own.
    """

    dialect = PGDialectAsync_psycopg()  # ``conn.dialect.name`` is what outbox.store asks

    def __init__(self, url: str, settings: Settings, cutoff: Cutoff) -> None:
        self._url = libpq_url(url)
        self._cutoff = cutoff
        self._settings = settings
        self._options = {**connect_options(settings), **startup_options(settings)}
        if settings.database_pooler == "transaction":
            self._options["prepare_threshold"] = None  # another client's statements may share the name
        self._timeout = settings.database_statement_timeout_seconds
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._pipeline: psycopg.AsyncPipeline | None = None  # inside transaction(): its statements' pipeline
        self._sql: dict[tuple[int, tuple[str, ...]], tuple[ClauseElement, str, tuple[str, ...]]] = {}

    @classmethod
    def of(cls, engine: AsyncEngine, settings: Settings) -> "DirectConnection | None":
        """A connection to ``engine``'s database if it is PostgreSQL (``None``: keep SQLAlchemy)."""
        if engine.dialect.name != "postgresql":
            return None
        return cls(engine.url.render_as_string(hide_password=False), settings, Cutoff.of(engine))

    async def execute(self, statement: ClauseElement, params: Params = None) -> DirectResult:
        """Run ``statement`` (a ``text()`` or an ``insert()`` of :mod:`outbox.schema`, kept for
        reuse: its rendering is cached by identity) with ``params``, or once per mapping of a
        list of them (no rows returned then). Inside :meth:`transaction` an INSERT without
        RETURNING is only sent, and its result (no rows, row count -1) returned at once."""
        async with self._guarded() as conn, AsyncRawCursor(conn, row_factory=namedtuple_row) as cursor:
            if isinstance(params, Sequence):
                if params:
                    sql, names = self._compiled(statement, params[0])
                    await cursor.executemany(sql, [tuple(row[n] for n in names) for row in params])
                return DirectResult([], cursor.rowcount)
            sql = await self._run(cursor, statement, params)
            if self._pipeline is not None:
                if _gives_nothing_back(sql):
                    return DirectResult([], -1)  # sent: it goes with the next statement or the COMMIT
                await self._pipeline.sync()
            return await _result(cursor)

    async def execute_after(self, first: ClauseElement, statement: ClauseElement,
                            params: Mapping[str, Any] | None = None) -> DirectResult:
        """Run ``first`` (no parameters, its rows dropped), then ``statement`` with ``params``,
        in one round trip and one transaction (a pipeline with one sync point): one commit,
        so one WAL flush, where two autocommit statements cost two of each.

        The claim runs so, folded due arrivals first (:func:`outbox.store.claim`): at low
        rates every message is claimed on its own and the flush is much of its wait
        (docs/performance.md, "Where a lone message's time goes")."""
        async with self._guarded() as conn, AsyncRawCursor(conn) as before, \
                AsyncRawCursor(conn, row_factory=namedtuple_row) as cursor:
            async with conn.pipeline():
                await self._run(before, first, None)
                await self._run(cursor, statement, params)
            return await _result(cursor)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator["DirectConnection"]:
        """Run the block's statements in one transaction (committed unless it raises), with
        one round trip per statement whose answer the block reads, and one for the ``COMMIT``.

        The block runs in a pipeline: ``BEGIN`` goes with the first statement whose answer is
        read, and a statement that returns nothing (an INSERT without RETURNING: a flush's
        attempt rows, its endpoint statistics) is only sent, to go with the next one or the
        ``COMMIT``. A flush of the common kind takes three round trips instead of six. A
        failure of such a statement shows at the ``COMMIT``, which then fails: the transaction
        is rolled back whole, as any failure in the block rolls it back.
        """
        async with self._guarded() as conn:
            try:
                async with conn.pipeline() as pipeline:
                    await conn.execute("BEGIN", prepare=False)
                    self._pipeline = pipeline
                    try:
                        yield self
                    finally:
                        self._pipeline = None
                    await conn.execute("COMMIT", prepare=False)  # goes, with what waits, as the pipeline ends
            except BaseException:
                if not conn.broken and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    await conn.execute("ROLLBACK", prepare=False)
                raise

    @asynccontextmanager
    async def _guarded(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """The connection, for a block held to the statement timeout; dropped if the block
        leaves it broken or timed out."""
        conn = await self._connection()
        try:
            with self._deadline(conn):
                yield conn
        except BaseException as exc:
            await self._forget_if_unusable(conn, exc)
            raise

    async def _run(self, cursor: AsyncRawCursor[Any], statement: ClauseElement,
                   params: Mapping[str, Any] | None) -> str:
        """Send ``statement``; inside :meth:`transaction` unprepared. After a statement fails
        inside a pipeline, psycopg can count as prepared a statement the server never kept,
        and every later run of it fails with "prepared statement does not exist" (seen when
        the database refuses a completion: tests/test_db_faults.py). A flush's statements run
        once per batch, so preparing them saved little."""
        sql, names = self._compiled(statement, params)
        await cursor.execute(sql, tuple(params[n] for n in names) if params else None,
                             prepare=False if self._pipeline is not None else None)
        return sql

    @contextmanager
    def _deadline(self, conn: psycopg.AsyncConnection[Any]) -> Iterator[None]:
        """Raise :class:`TimeoutError` if the block outlasts the statement timeout.

        The connection's socket is shut down when the time is up, so the statement fails at
        once. (Cancelling the task instead would have psycopg ask the server to cancel the
        statement first, through a new connection to the same unreachable address, for up
        to 10 s more.)
        """
        with severed_after(conn, self._timeout) as expired:
            try:
                yield
            except psycopg.Error as exc:
                if expired():
                    raise TimeoutError(f"no answer from the database within {self._timeout:g} s") from exc
                raise

    async def _forget_if_unusable(self, conn: psycopg.AsyncConnection[Any], exc: BaseException) -> None:
        """Drop a connection that is broken or timed out (its state is unknown): the next
        statement opens a new one."""
        if isinstance(exc, TimeoutError) or conn.closed or conn.broken:
            self._conn = None
            await conn.close()

    async def aclose(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            async with asyncio.timeout(self._timeout):
                conn = await self._cutoff.connect(self._url, autocommit=True, **self._options)
                if "options" in self._options:
                    try:
                        row = await (await conn.execute(STARTUP_CHECK)).fetchone()
                        check_startup_options(row[0] if row else None)
                    except BaseException:
                        await conn.close()
                        raise
                self._conn = conn
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
