"""How long the daemon tolerates a failing database before it gives up, and why it fails.

Short outages (a PostgreSQL restart, a failover) are ridden out with capped back-off; a
failure longer than ``OUTBOX_DATABASE_OUTAGE_SECONDS`` ends the process with a non-zero
status, so systemd or Kubernetes restarts it and the operator sees it. Leases make either
path safe: nothing in flight is lost, it is re-leased after expiry.

The guard counts failed statements, per activity (claiming, recording outcomes, ...), not
only lost connections: a claim that keeps failing is an outage even while other statements
succeed, so one activity's success never hides another's stall. A failure that retrying
cannot cure (prepared statements or startup options through a transaction pooler) is named at once, on
``/readyz``, in the log and in ``outbox_database_errors_total{cause}``, and is not retried:
the activity waits out the deadline and the daemon exits (docs/pooler.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog

from supervisor.cycle.cutoff import Cutoff
from supervisor.cycle.pgdirect import StartupOptionsIgnored

# SQLSTATEs of a prepared statement that is not where the client left it: 26000 "prepared
# statement does not exist", 42P05 "already exists", and 08P01 (protocol violation) for a
# bind that reached another client's statement of the same name.
_PREPARED_STATES = frozenset({"26000", "42P05"})
# admin_shutdown (a restart, a terminated backend), crash_shutdown, cannot_connect_now.
_SHUTDOWN_STATES = frozenset({"57P01", "57P02", "57P03"})
POOLER_HINT = ("prepared statements through a transaction pooler; set OUTBOX_DATABASE_POOLER=transaction "
               "(docs/pooler.md)")
STARTUP_HINT = ("a connection pooler refused the connection's startup options; set OUTBOX_DATABASE_POOLER=transaction "
                "(PgBouncer refuses them in any pool mode; docs/pooler.md)")
DROPPED_HINT = ("a connection pooler dropped the connection's startup options; set OUTBOX_DATABASE_POOLER=transaction "
                "(docs/pooler.md)")


class DatabaseUnavailable(RuntimeError):
    """The database stayed unreachable (or kept failing) past the configured deadline."""


@dataclass(frozen=True)
class Cause:
    """Why a database call failed: a metric label and a line for the operator."""

    label: str  # prepared_statements | pooler_startup | timeout | connection | statement
    text: str

    @property
    def curable(self) -> bool:
        """Whether retrying may help (a misconfiguration stays until the operator acts)."""
        return self.label not in ("prepared_statements", "pooler_startup")


# What PgBouncer says when one of its own limits, not the database, ended a statement or refused
# a connection: each named with the setting to look at (its errors arrive as protocol errors,
# which would otherwise read as "database unreachable").
_POOLER_REFUSALS = (
    ("max_client_conn", Cause("connection", "the connection pooler refused a connection: its max_client_conn is "
                                            "reached (raise it, or run fewer clients)")),
    ("query_wait_timeout", Cause("timeout", "waited past the connection pooler's query_wait_timeout for a server "
                                            "connection (its pool is too small for its clients)")),
    ("query timeout", Cause("timeout", "the connection pooler ended a statement at its query_timeout")),
)


# SQLite's errors that are not a lost connection, though sqlite3 raises them all alike.
_SQLITE_FAILURES = (
    ("is locked", Cause("timeout", "the SQLite write lock was held past the busy timeout (30 s) by another "
                                   "process: a long transaction of the seller's, or another writer")),
    ("readonly database", Cause("statement", "the SQLite file, or its directory, is read-only to this process: it "
                                             "writes the file and the -wal and -shm files beside it")),
    ("unable to open database file", Cause("connection", "SQLite cannot open the file: its directory must exist "
                                                         "and be writable (the -wal and -shm files go beside it)")),
)


def diagnose(exc: BaseException) -> Cause:
    """The cause of a failed database call, from the driver's error (SQLAlchemy's or psycopg's)."""
    error = getattr(exc, "orig", None) or exc
    state = getattr(error, "sqlstate", None)
    if state in _PREPARED_STATES or (state == "08P01" and "prepared statement" in str(error)):
        return Cause("prepared_statements", POOLER_HINT)
    if "unsupported startup parameter" in str(error):  # PgBouncer refuses libpq's "options"
        return Cause("pooler_startup", STARTUP_HINT)
    if isinstance(error, StartupOptionsIgnored):  # ... or, told to ignore them, drops them
        return Cause("pooler_startup", DROPPED_HINT)
    if isinstance(error, TimeoutError):
        return Cause("timeout", "statement timed out (OUTBOX_DATABASE_STATEMENT_TIMEOUT_SECONDS)")
    if state == "57014":  # the server's own cancel: not the client deadline that variable sets
        return Cause("timeout", "statement cancelled by PostgreSQL (a statement_timeout of the server, database or "
                                "role, or an administrator's cancel)")
    for words, cause in _POOLER_REFUSALS:  # PgBouncer's own errors name its settings, not the database's
        if words in str(error):
            return cause
    if type(error).__module__ == "sqlite3":  # every one an OperationalError: named by its words
        for words, cause in _SQLITE_FAILURES:
            if words in str(error):
                return cause
    if isinstance(error, OSError) or _lost_connection(error, state):
        return Cause("connection", f"database unreachable ({type(error).__name__})")
    return Cause("statement", f"statement failed ({type(error).__name__})")


def _lost_connection(error: BaseException, state: str | None) -> bool:
    """Whether ``error`` says the connection failed or ended, rather than a statement.

    By the error's class names (psycopg's and sqlite3's errors share them, and psycopg's are
    subclassed per condition: ``ConnectionTimeout``, ``AdminShutdown``), for an error the
    client raised itself (no SQLSTATE), of the connection exception class (08) or of a
    server shutting down or starting up (57P01-57P03); not for a server's statement error
    that is also an ``OperationalError`` (a full disk, too many connections)."""
    if state is not None and not state.startswith("08") and state not in _SHUTDOWN_STATES:
        return False
    return any(kind.__name__ in ("OperationalError", "InterfaceError") for kind in type(error).__mro__)


class OutageGuard:
    def __init__(self, deadline_seconds: float, on_outage: Callable[[], None] | None = None,
                 on_error: Callable[[str], None] | None = None, quiet: Callable[[], bool] = lambda: False) -> None:
        self._deadline = deadline_seconds
        self._on_outage = on_outage  # called once when an outage begins (the metric)
        self._on_error = on_error  # called with the cause's label of every failure
        self._quiet = quiet  # True once failures are the daemon's own doing (its cut): neither logged nor counted
        self._failing: dict[str, tuple[float, int, Cause]] = {}  # activity -> (since, failures, last cause)
        self._incurable: tuple[float, str, Cause] | None = None  # (since, activity, cause): never cleared
        self._log = structlog.get_logger("outboxd.database")
        self.recovered = asyncio.Event()  # set when an outage ends (the clock re-measures)

    def ok(self, doing: str) -> None:
        """``doing`` succeeded: its failures are over (an outage ends when no activity fails)."""
        failing = self._failing.pop(doing, None)
        if failing is not None and not self._failing and self._incurable is None:
            self._log.info("database.recovered", outage_seconds=round(time.monotonic() - failing[0], 2))
            self.recovered.set()

    def problem(self) -> str | None:
        """One line for ``/readyz`` while an activity keeps failing (``None``: all is well)."""
        if self._incurable is not None:
            return f"database: {self._incurable[2].text} (while trying to {self._incurable[1]})"
        if not self._failing:
            return None
        doing, (since, _, cause) = min(self._failing.items(), key=lambda item: item[1][0])
        return f"database failing for {time.monotonic() - since:.0f} s: {cause.text} (while trying to {doing})"

    async def failed(self, doing: str, exc: BaseException) -> None:
        """Note a failure of ``doing`` and wait before the caller retries; raise past the deadline.

        An incurable failure is not retried: the call waits out the deadline, then raises.
        """
        now = time.monotonic()
        cause = diagnose(exc)
        since, failures, _ = self._failing.get(doing, (now, 0, cause))
        if self._quiet():
            await asyncio.sleep(_backoff(failures))
            return
        if self._on_error is not None:
            self._on_error(cause.label)
        if not self._failing and self._incurable is None and self._on_outage is not None:
            self._on_outage()
        self._failing[doing] = (since, failures + 1, cause)
        if not cause.curable and self._incurable is None:
            self._incurable = (now, doing, cause)
            self._log.critical("database.misconfigured", doing=doing, cause=cause.label, reason=cause.text,
                               error=type(exc).__name__, detail=str(exc)[:200],
                               exit_in_seconds=round(self._deadline, 1))
        if self._incurable is not None:
            since, doing, cause = self._incurable
            await asyncio.sleep(max(self._deadline - (time.monotonic() - since), 0.0) + 0.01)
        elapsed = time.monotonic() - since
        if elapsed > self._deadline:
            self._log.critical("database.unreachable", doing=doing, outage_seconds=round(elapsed, 1),
                               cause=cause.label, reason=cause.text, error=type(exc).__name__)
            if cause.label == "connection":
                raise DatabaseUnavailable(
                    f"database unreachable for {elapsed:.0f} s (while trying to {doing})") from exc
            raise DatabaseUnavailable(f"database failing for {elapsed:.0f} s (while trying to {doing}): "
                                      f"{cause.text}") from exc
        if failures == 0 or (failures + 1) % 10 == 0:
            self._log.error("database.error", doing=doing, cause=cause.label, reason=cause.text,
                            error=type(exc).__name__, detail=str(exc)[:200], outage_seconds=round(elapsed, 1))
        await asyncio.sleep(_backoff(failures))


def _backoff(failures: int) -> float:
    """Seconds before the next try after ``failures`` failures in a row: 0.2 s, doubling, at most 5 s."""
    return min(0.2 * 2 ** min(failures, 5), 5.0)


T = TypeVar("T")


async def unless_stopped(stop: asyncio.Event, work: Awaitable[T], cutoff: Cutoff | None = None) -> T | None:
    """``work``'s result, or ``None`` if ``stop`` is set first (``work`` is then cancelled, or,
    given a ``cutoff``, its connections are cut first: at start, when nothing is claimed).

    Waiting for a database that is away (a connect, :meth:`OutageGuard.failed`'s back-off,
    which lasts until ``OUTBOX_DATABASE_OUTAGE_SECONDS`` for a misconfiguration) must not
    outlast a SIGTERM: what waits so has claimed nothing it must finish. A statement merely
    cancelled would first have psycopg ask an unreachable server to cancel it (10 s)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
        stopped_first = not task.done()
        if stopped_first and cutoff is not None:
            await cutoff.abandon(task)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, stopped, return_exceptions=True)
    return None if stopped_first else task.result()
