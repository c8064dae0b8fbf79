"""An enqueue's INSERT sent with the seller's next round trip instead of in one of its own.

What an enqueue adds to the seller's transaction is mostly the INSERT's round trip to the
server and back (docs/performance.md, "The seller's enqueue"). On a psycopg 3 connection
(synchronous, not in autocommit) a message whose idempotency key the enqueue minted (so no
stored message can hold it, and there is no twin to look up) is *parked* on the connection:
rendered and validated at once, but sent with whatever the transaction sends next:

* the ``COMMIT``: the parked INSERTs and the ``COMMIT`` go in one pipeline, one round trip
  for all of them (the common case: the enqueue is the transaction's last statement);
* any other statement: the parked INSERTs are sent first, in a round trip of their own, as
  without parking.

So the server runs every statement in the order the seller issued them: a later read in the
transaction sees the row, a savepoint rolled back drops it, and the message exists if and
only if the transaction commits. A rollback drops what is still parked, unsent.

What changes for the caller: the message's id comes back with the ``COMMIT``
(:attr:`outbox.EnqueuedMessage.id` read sooner sends the parked rows at once, one round trip),
and an INSERT that fails (nothing validation can foresee: a schema not migrated, the database
going away) fails the statement it went with, usually the ``COMMIT``, which rolls the
transaction back. docs/enqueue.md, "When the row is written", says so to sellers.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from typing import Any
from weakref import WeakKeyDictionary, WeakSet

import psycopg
from sqlalchemy import Connection, Engine, event
from sqlalchemy.engine import Dialect, TwoPhaseTransaction
from sqlalchemy.sql import ClauseElement

from outbox.errors import MessageRolledBack

__all__ = ["ParkedInsert", "park", "parking_connection"]

_PARKED: WeakKeyDictionary[psycopg.Connection[Any], list["ParkedInsert"]] = WeakKeyDictionary()
_HOOKED: WeakSet[Engine] = WeakSet()
_HOOKING = threading.Lock()


class ParkedInsert:
    """One parked ``INSERT ... RETURNING id``: its rendering, and the id once it has run."""

    __slots__ = ("_sql", "_params", "_raw", "_cursor", "_id", "_dropped")

    def __init__(self, sql: str, params: Mapping[str, Any], raw: psycopg.Connection[Any]) -> None:
        self._sql, self._params, self._raw = sql, params, raw
        self._cursor: psycopg.Cursor[Any] | None = None
        self._id: int | None = None
        self._dropped = False

    def id(self) -> int:
        """The stored row's id: sends this connection's parked rows first if still parked."""
        if self._id is None:
            if self._dropped:
                raise MessageRolledBack()
            _send_parked(self._raw)
        assert self._id is not None
        return self._id

    def written(self) -> int | None:
        """The id if the row has been written, without writing it."""
        return self._id

    def _send(self) -> None:
        self._cursor = self._raw.cursor()
        self._cursor.execute(self._sql, self._params)

    def _collect(self) -> None:
        assert self._cursor is not None
        with self._cursor as cursor:
            (self._id,) = cursor.fetchone() or (None,)


def parking_connection(connection: Connection) -> psycopg.Connection[Any] | None:
    """The psycopg connection a message may be parked on, or ``None`` (send it now): only a
    synchronous psycopg 3 connection in a transaction it commits itself (not autocommit, not
    two-phase: a prepared transaction commits without a ``COMMIT``)."""
    if connection.dialect.name != "postgresql" or isinstance(connection.get_transaction(), TwoPhaseTransaction):
        return None
    raw = connection.connection.driver_connection
    if not isinstance(raw, psycopg.Connection) or raw.autocommit:
        return None
    return raw


def park(connection: Connection, raw: psycopg.Connection[Any], statement: ClauseElement,
         values: Mapping[str, Any]) -> ParkedInsert:
    """Park ``statement`` (an ``INSERT ... RETURNING id`` that fails rather than writing
    nothing: a parked row has no twin to return) with ``values`` on ``raw``, the connection
    :func:`parking_connection` gave for ``connection``."""
    _hook(connection.engine)
    if not connection.in_transaction():
        connection.begin()  # as the INSERT's execution would have: the seller's commit is what sends it
    parked = ParkedInsert(_rendered(statement, connection.dialect, tuple(values)), dict(values), raw)
    _PARKED.setdefault(raw, []).append(parked)
    return parked


@functools.lru_cache(maxsize=64)  # a handful of column sets; compiling an INSERT costs ~0.4 ms of CPU
def _rendered(statement: ClauseElement, dialect: Dialect, columns: tuple[str, ...]) -> str:
    return str(statement.compile(dialect=dialect, column_keys=list(columns)))


def _hook(engine: Engine) -> None:
    """Listen once per engine: every statement, commit and rollback of its connections first
    deals with what is parked on them, and so does the pool taking a connection back."""
    if engine in _HOOKED:
        return
    with _HOOKING:
        if engine in _HOOKED:
            return
        event.listen(engine, "before_cursor_execute", _before_statement)
        event.listen(engine, "commit", _with_commit)
        event.listen(engine, "rollback", _drop)
        event.listen(engine, "reset", _drop_on_reset)
        _HOOKED.add(engine)


def _raw(connection: Connection) -> Any:
    return connection.connection.driver_connection


def _before_statement(connection: Connection, *_args: Any) -> None:
    raw = _raw(connection)
    if raw in _PARKED:
        _send_parked(raw)


def _send_parked(raw: psycopg.Connection[Any], *, commit: bool = False) -> None:
    """Send what is parked on ``raw`` in one pipeline, one round trip (with the ``COMMIT``
    last when ``commit``). If it fails, the transaction is aborted and the rows with it."""
    parked = _PARKED.pop(raw, [])
    try:
        with raw.cursor() as cursor, raw.pipeline():
            for row in parked:
                row._send()
            if commit:
                cursor.execute("COMMIT", prepare=False)
        for row in parked:
            row._collect()
    except BaseException:
        for row in parked:
            row._dropped = True
        raise


def _with_commit(connection: Connection) -> None:
    """The parked rows and the ``COMMIT`` in one pipeline. The driver then finds its
    transaction ended and SQLAlchemy's own commit sends nothing. A failure is raised as
    SQLAlchemy raises a failed commit's."""
    raw = _raw(connection)
    if raw in _PARKED:
        try:
            _send_parked(raw, commit=True)
        except psycopg.Error as exc:
            if not raw.broken:  # the COMMIT was never run: end the transaction as a failed one ends
                raw.rollback()
            connection._handle_dbapi_exception(exc, "COMMIT", None, None, None)  # raised as a failed commit's


def _drop(connection: Connection) -> None:
    _forget(_raw(connection))


def _drop_on_reset(dbapi_connection: Any, _record: Any, _state: Any) -> None:
    """A connection going back to the pool (closed, or dropped without closing) ends its
    transaction unsent: what is parked on it must never ride another transaction."""
    _forget(dbapi_connection)


def _forget(raw: Any) -> None:
    for row in _PARKED.pop(raw, []):
        row._dropped = True
