"""An enqueue's INSERT sent with the seller's next round trip instead of in one of its own.

What an enqueue adds to the seller's transaction is mostly the INSERT's round trip to the
server and back (docs/performance.md, "What an enqueue adds, against the SDK's"). On a
psycopg 3 connection (synchronous, not in autocommit, not two-phase) a message whose
idempotency key the enqueue minted (so no stored message can hold it, and there is no twin to
look up) is *parked* on the connection: rendered and validated at once, but sent with
whatever the transaction sends next:

* the ``COMMIT``: the parked INSERTs and the ``COMMIT`` go in one pipeline, one round trip
  for all of them (the common case: the enqueue is the transaction's last statement). This
  happens where SQLAlchemy commits (the dialect's ``do_commit``), after every ``commit``
  listener has run, so a listener that refuses the commit still stops the rows;
* any other statement: the parked INSERTs are sent first, in a round trip of their own, as
  without parking.

So the server runs every statement in the order the seller issued them: a later read in the
transaction sees the row, a savepoint rolled back drops it, and the message exists if and
only if the transaction commits. What is parked follows the driver connection's transaction
wherever it ends: a rollback (SQLAlchemy's, the pool's as it takes a connection back, or the
driver connection's own) or an invalidated connection drops it unsent; a commit (a pool's on
return, or the driver connection's own) sends it; a transaction ended by a statement nothing
wraps (a ``COMMIT`` sent on the driver connection) drops it, said, so the next never writes it.

What changes for the caller: the message's id comes back with the ``COMMIT``
(:attr:`outbox.EnqueuedMessage.id` read sooner, on the thread that enqueued, writes the row
at once; read on another thread, it waits for the transaction to end), and an INSERT that
fails (nothing validation can foresee: a schema not migrated, the database going away) fails
the statement it went with, usually the ``COMMIT``, which rolls the transaction back.
docs/enqueue.md, "When the row is written", says so to sellers.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any
from weakref import WeakKeyDictionary, WeakSet

import psycopg
from sqlalchemy import Connection, Insert
from sqlalchemy.engine import Dialect, TwoPhaseTransaction
from sqlalchemy.engine.default import DefaultDialect

from outbox.errors import MessageNotWritten, MessageOutcomeUnknown, MessageRolledBack

__all__ = ["ParkedInsert", "park", "parking_connection"]

_PARKED: WeakKeyDictionary[psycopg.Connection[Any], list["ParkedInsert"]] = WeakKeyDictionary()
_WRAPPED: WeakSet[Dialect] = WeakSet()
_HOOKING = threading.Lock()
ROLLED_BACK, UNANSWERED, ENDED_UNSEEN = "rolled back", "COMMIT unanswered", "transaction ended unseen"
_IDLE = psycopg.pq.TransactionStatus.IDLE
_log = logging.getLogger(__name__)


class ParkedInsert:
    """One parked ``INSERT ... RETURNING id``: what it sends, and the id once it has run."""

    __slots__ = ("_statement", "_values", "_sql", "_raw", "_connection", "_owner", "_ended", "_cursor", "_id",
                 "_fate", "_in_open_transaction")

    def __init__(self, connection: Connection, raw: psycopg.Connection[Any], statement: Insert,
                 values: Mapping[str, Any]) -> None:
        self._statement, self._values = statement, dict(values)
        self._sql = _rendered(statement, connection.dialect, tuple(self._values))
        # Weakly: a connection its seller dropped unfinished must still go back to the pool
        # (its transaction rolled back, what is parked dropped), not stay checked out, its
        # transaction open, for as long as the record or the parked row is kept.
        self._raw = raw
        self._connection: Callable[[], Connection | None] = weakref.ref(connection)
        self._owner = threading.get_ident()
        self._ended = threading.Event()  # written or dropped
        self._cursor: psycopg.Cursor[Any] | None = None
        self._id: int | None = None
        self._fate: str | None = None  # why it has no id: ROLLED_BACK, UNANSWERED (written or not), ENDED_UNSEEN
        # Parked after the transaction's first statement: finding the connection idle later means
        # that transaction ended unseen (:func:`_take`).
        self._in_open_transaction = raw.info.transaction_status != _IDLE

    def id(self) -> int:
        """The stored row's id. Still parked: on the thread that parked it, the row is written
        now, through SQLAlchemy (its errors are SQLAlchemy's); on another thread, this waits
        for the transaction to end (that thread owns the connection)."""
        if not self._ended.is_set():
            if threading.get_ident() == self._owner:
                _write_now(self._connection(), self._raw)
            self._ended.wait()
        if self._id is None:
            if self._fate == UNANSWERED:
                raise MessageOutcomeUnknown(self._values["idempotency_key"])
            raise MessageNotWritten() if self._fate == ENDED_UNSEEN else MessageRolledBack()
        return self._id

    def written(self) -> int | str | None:
        """Without writing it: the id if written, why it never will be (:data:`ROLLED_BACK`,
        :data:`UNANSWERED`, :data:`ENDED_UNSEEN`), or ``None`` while it waits for the ``COMMIT``."""
        return self._id if self._id is not None else self._fate

    def _send(self) -> None:
        self._cursor = self._raw.cursor()
        self._cursor.execute(self._sql, self._values)

    def _collect(self) -> None:
        assert self._cursor is not None
        with self._cursor as cursor:
            (self._id,) = cursor.fetchone() or (None,)
        self._end()

    def _drop(self, fate: str = ROLLED_BACK) -> None:
        self._fate = fate
        self._end()

    def _end(self) -> None:
        self._connection = lambda: None  # nothing more to send on it
        self._ended.set()


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


def park(connection: Connection, raw: psycopg.Connection[Any], statement: Insert,
         values: Mapping[str, Any]) -> ParkedInsert:
    """Park ``statement`` (an ``INSERT ... RETURNING id`` that fails rather than writing
    nothing: a parked row has no twin to return) with ``values`` on ``raw``, the connection
    :func:`parking_connection` gave for ``connection``."""
    _hook(connection.dialect)
    _hook_driver(raw)
    if not connection.in_transaction():
        connection.begin()  # as the INSERT's execution would have: the seller's commit is what sends it
    parked = ParkedInsert(connection, raw, statement, values)
    _PARKED.setdefault(raw, []).append(parked)
    return parked


@functools.lru_cache(maxsize=64)  # a handful of column sets; compiling an INSERT costs ~0.4 ms of CPU
def _rendered(statement: Insert, dialect: Dialect, columns: tuple[str, ...]) -> str:
    return str(statement.compile(dialect=dialect, column_keys=list(columns)))


def _hook(dialect: Dialect) -> None:
    """Wrap the seller dialect's own calls once: each statement it runs first sends what is
    parked on the connection, its commit carries it, its rollback (SQLAlchemy's, or the
    pool's as it takes a connection back) and its close (an invalidated connection) drop it.
    So what is parked follows the driver connection's transaction wherever it ends, a pool
    that commits on return included. Engines share their dialect with every
    ``execution_options(...)`` engine made from them. No event listener: one on an engine has
    SQLAlchemy dispatch every event of every statement of it (30 µs more per transaction,
    measured), where these wrappers cost one check."""
    if dialect in _WRAPPED:
        return
    with _HOOKING:
        if dialect in _WRAPPED:
            return
        for name in ("do_execute", "do_executemany", "do_execute_no_params"):
            setattr(dialect, name, _sending_first(getattr(dialect, name)))
        # A dialect class with a commit of its own (a seller's subclass: an audit, a metric) has
        # it called, after the rows' round trip; only the DBAPI's plain commit is pipelined.
        pipelined = type(dialect).do_commit is DefaultDialect.do_commit
        setattr(dialect, "do_commit", _committing(dialect.do_commit, pipelined))
        for name in ("do_rollback", "do_close", "do_terminate"):
            setattr(dialect, name, _dropping_first(getattr(dialect, name)))
        _WRAPPED.add(dialect)


def _driver(dbapi_connection: Any) -> Any:
    """The psycopg connection of what SQLAlchemy hands a dialect (a pool's proxy or the connection)."""
    return getattr(dbapi_connection, "driver_connection", dbapi_connection)


def _sending_first(plain: Callable[..., None]) -> Callable[..., None]:
    """A statement of the dialect's, after what is parked on its connection."""

    def run(cursor: Any, *args: Any) -> None:
        raw = cursor.connection
        if raw in _PARKED:
            context = args[-1]  # SQLAlchemy's execution context, last of every do_execute* call
            _send_parked(raw, invalidate=lambda: context.root_connection.invalidate())
        plain(cursor, *args)

    return run


def _committing(plain_commit: Callable[[Any], None], pipelined: bool) -> Callable[[Any], None]:
    """The dialect's commit, carrying what is parked on the connection (``pipelined``: in one
    round trip with the ``COMMIT``). SQLAlchemy calls it after the ``commit`` listeners and
    raises its failure as a failed commit's."""

    def do_commit(dbapi_connection: Any) -> None:
        raw = _driver(dbapi_connection)
        if raw in _PARKED and pipelined:
            _commit_parked(raw, invalidate=dbapi_connection.invalidate)
            return
        if raw in _PARKED:
            _send_parked(raw, invalidate=dbapi_connection.invalidate)
        plain_commit(dbapi_connection)

    return do_commit


def _commit_parked(raw: psycopg.Connection[Any], invalidate: Callable[[], object]) -> None:
    """What is parked on ``raw`` and the ``COMMIT``, in one round trip; a failure before the
    ``COMMIT`` ran ends the transaction as a failed commit ends."""
    try:
        _send_parked(raw, commit=True, invalidate=invalidate)
    except psycopg.Error:
        if not (raw.broken or raw.closed):
            raw.rollback()
        raise


def _hook_driver(raw: psycopg.Connection[Any]) -> None:
    """Wrap ``raw``'s own ``commit`` and ``rollback`` once, so a transaction the seller ends on
    the driver connection (``connection.connection.driver_connection.commit()``, or psycopg's
    ``with conn:``) carries or drops what is parked as the dialect's calls do. Through a weak
    reference and the class's functions: the wrappers keep nothing alive."""
    if "commit" in vars(raw):
        return
    ref, cls = weakref.ref(raw), type(raw)

    def commit() -> None:
        conn = ref()
        if conn in _PARKED:
            _commit_parked(conn, invalidate=lambda: None)  # type: ignore[arg-type]
        else:
            cls.commit(conn)  # type: ignore[arg-type]

    def rollback() -> None:
        conn = ref()
        _forget(conn)
        cls.rollback(conn)  # type: ignore[arg-type]

    raw.commit, raw.rollback = commit, rollback  # type: ignore[method-assign]


def _take(raw: psycopg.Connection[Any]) -> list[ParkedInsert]:
    """What is parked on ``raw``, to send now: nothing if the transaction it was parked in has
    ended where no wrapper saw it (a ``COMMIT`` or ``ROLLBACK`` statement the seller sent on
    the driver connection). Those rows, never sent, are dropped and said, never written into
    the connection's next transaction: whether their transaction committed is not known here."""
    rows = _PARKED.pop(raw, [])
    if rows and any(row._in_open_transaction for row in rows) and raw.info.transaction_status == _IDLE:
        for row in rows:
            row._drop(ENDED_UNSEEN)
        _log.error("outbox: the transaction %d message(s) were enqueued in ended outside SQLAlchemy (a COMMIT or "
                   "ROLLBACK statement on the driver connection) before their rows were sent; they were not "
                   "written (idempotency_key %s)", len(rows), ", ".join(row._values["idempotency_key"] for row in rows))
        return []
    return rows


def _dropping_first(plain: Callable[[Any], None]) -> Callable[[Any], None]:
    """The dialect's rollback or close, dropping what is parked on the connection first."""

    def end(dbapi_connection: Any) -> None:
        _forget(_driver(dbapi_connection))
        plain(dbapi_connection)

    return end


def _write_now(connection: Connection | None, raw: psycopg.Connection[Any]) -> None:
    """Write what is parked on ``raw`` now, one statement each through SQLAlchemy, so that a
    failure is raised, and a disconnect invalidates, as any statement's would."""
    if connection is None:  # dropped unfinished by the seller: its transaction can never commit
        _forget(raw)
        return
    rows = _take(raw)
    try:
        for row in rows:
            row._id = connection.execute(row._statement, row._values).scalar_one()
            row._end()
    except BaseException:
        for row in rows:
            if not row._ended.is_set():
                row._drop()
        raise


def _send_parked(raw: psycopg.Connection[Any], *, commit: bool = False,
                 invalidate: Callable[[], object] = lambda: None) -> None:
    """Send what is parked on ``raw`` in one pipeline, one round trip (with the ``COMMIT``
    last when ``commit``). If it fails, the transaction is aborted and the rows with it, unless
    the connection was lost with the ``COMMIT`` sent: then whether it took effect is unknown.
    A connection this leaves unusable is closed and ``invalidate``-d (SQLAlchemy's own: the
    pool must not hand it out again)."""
    rows = _take(raw)
    was_open = not (raw.closed or raw.broken)
    try:
        with raw.cursor() as cursor, raw.pipeline():
            for row in rows:
                row._send()
            if commit:
                cursor.execute("COMMIT", prepare=False)
        for row in rows:
            row._collect()
    except BaseException as exc:
        interrupt = None
        if not raw.closed and raw.pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF:
            # Interrupted inside the pipeline (a signal's exception, Ctrl-C): its answers unread,
            # the connection cannot leave pipeline mode, and nothing else can run on it. Closed,
            # it is discarded as a lost connection is, and the COMMIT, if sent, unanswered.
            raw.close()
            invalidate()
            interrupt = exc.__context__ if isinstance(exc, psycopg.Error) else None
        unanswered = commit and was_open and (raw.closed or raw.broken)
        for row in rows:
            row._drop(UNANSWERED if unanswered else ROLLED_BACK)
        if interrupt is not None and not isinstance(interrupt, psycopg.Error):
            raise interrupt  # itself, not the driver's failure to leave pipeline mode over it
        raise


def _forget(raw: Any) -> None:
    for row in _PARKED.pop(raw, []):
        row._drop()
