"""Cutting the daemon's database connections once a stop may wait for the database no longer.

A database that stops answering without closing anything (a network black hole, a stuck
pooler) leaves every statement waiting for its deadline, and a new connection waiting for
the connect timeout. Cancelling a waiting statement does not help: psycopg first asks the
server to cancel it, through a new connection to the same unreachable address, for up to
10 s more per connection. A stop that waited so, step after step, would run past the 30 s
the shipped manifests allow before SIGKILL (docs/operations.md, "Stopping").

So the daemon cuts instead, when its stop has waited for the database as long as it may:
every PostgreSQL connection it holds (its engine's and the claimer's and completer's own)
has its socket shut down and every one still being opened is abandoned, which fails
whatever waits on them at once, and no new one is opened. The rest of the stop (closing
the sinks, the HTTP sender, the metrics endpoint) no longer waits for the database. What
was left unrecorded is sent again once its lease runs out, as after a crash.
"""

from __future__ import annotations

import asyncio
import os
import socket
import weakref
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import structlog
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["Cutoff", "bound_each_hold", "sever", "severed_after"]

# How long work that was cut is given to fail before it is cancelled.
SETTLE_SECONDS = 1.0
_REFUSED = "the daemon is stopping and waits for the database no longer"
_BY_ENGINE: "weakref.WeakKeyDictionary[Any, Cutoff]" = weakref.WeakKeyDictionary()


def sever(conn: psycopg.AsyncConnection[Any]) -> None:
    """Shut down ``conn``'s socket: what waits on it fails at once, with no cancel request."""
    try:
        with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except (psycopg.Error, OSError):  # closed meanwhile: nothing left to stop
        pass


@contextmanager
def severed_after(conn: psycopg.AsyncConnection[Any], seconds: float) -> Iterator[Callable[[], bool]]:
    """Within the block, ``conn`` is severed once ``seconds`` have passed: a statement the
    database leaves unanswered fails then. Yields whether that has happened."""
    severed = False

    def expire() -> None:
        nonlocal severed
        severed = True
        sever(conn)

    timer = asyncio.get_running_loop().call_later(seconds, expire)
    try:
        yield lambda: severed
    finally:
        timer.cancel()


def bound_each_hold(engine: AsyncEngine, seconds: float) -> None:
    """Sever a connection of ``engine`` held out of its pool longer than ``seconds``.

    For the console, whose pages each hold a connection for a few short statements: a
    statement the database leaves unanswered then fails at once, the page answers, and the
    process can stop; nothing else would end it (no client deadline on the engine's
    statements; a server-side ``statement_timeout`` is never heard from a black hole)."""
    if engine.dialect.name != "postgresql":
        return

    @event.listens_for(engine.sync_engine, "checkout")
    def _arm(dbapi: Any, record: Any, _proxy: Any) -> None:
        record.info["sever_at"] = asyncio.get_running_loop().call_later(seconds, sever, dbapi.driver_connection)

    @event.listens_for(engine.sync_engine, "checkin")
    def _disarm(_dbapi: Any, record: Any) -> None:
        timer = record.info.pop("sever_at", None)
        if timer is not None:
            timer.cancel()


class Cutoff:
    """The PostgreSQL connections opened for one engine's database, and whether they are cut.

    One per engine (:meth:`of`): the engine's pool reports each connection it opens, and
    :class:`supervisor.cycle.pgdirect.DirectConnection` reports its own (:meth:`track`).
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self._live: weakref.WeakSet[psycopg.AsyncConnection[Any]] = weakref.WeakSet()
        self._opening: set[asyncio.Future[psycopg.AsyncConnection[Any]]] = set()
        self.is_cut = False
        if engine.dialect.name == "postgresql":
            event.listen(engine.sync_engine, "do_connect", self._open_engine_connections_here)
            event.listen(engine.sync_engine, "connect", lambda dbapi, _record: self.track(dbapi.driver_connection))

    def _open_engine_connections_here(self, _dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
        cparams["async_creator_fn"] = self._open  # what SQLAlchemy's psycopg dialect connects with

    @classmethod
    def of(cls, engine: AsyncEngine) -> "Cutoff":
        """``engine``'s cutoff (made on first use)."""
        found = _BY_ENGINE.get(engine.sync_engine)
        if found is None:
            found = _BY_ENGINE[engine.sync_engine] = cls(engine)
        return found

    def track(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Count ``conn`` among the connections :meth:`cut` shuts down."""
        self._live.add(conn)

    async def connect(self, url: str, **options: Any) -> psycopg.AsyncConnection[Any]:
        """A new connection to ``url`` (libpq ``options``), counted among those :meth:`cut`
        shuts down; refused once cut. For the connections the daemon opens outside its
        engine: the claimer's and completer's, and LISTEN's."""
        conn = await self._open(url, **options)
        self.track(conn)
        return conn

    async def _open(self, *args: Any, **kwargs: Any) -> psycopg.AsyncConnection[Any]:
        """psycopg's connect, which a cut fails at once: the server's answer to its startup
        may be what a black hole swallows, and nothing else would end it before its timeout."""
        self.refuse_once_cut()
        attempt = asyncio.ensure_future(psycopg.AsyncConnection.connect(*args, **kwargs))
        self._opening.add(attempt)
        try:
            return await attempt
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if attempt.cancelled() and self.is_cut and (task is None or not task.cancelling()):
                raise psycopg.OperationalError(_REFUSED) from None  # the cut's cancel, not the caller's
            raise
        finally:
            self._opening.discard(attempt)

    def refuse_once_cut(self) -> None:
        """Raise instead of opening a connection after :meth:`cut`."""
        if self.is_cut:
            raise psycopg.OperationalError(_REFUSED)

    def cut(self) -> int:
        """Shut down every open connection's socket, end every one being opened, and open no
        more; how many were open.

        The first cut says so in the log: the database errors of the daemon's last moments
        are the cut's own, and are neither logged nor counted (:attr:`is_cut`), so the
        operator is not sent looking for a server that closed connections."""
        open_now = [conn for conn in list(self._live) if not conn.closed]
        if not self.is_cut:
            structlog.get_logger("outboxd.database").warning(
                "database.cut", connections=len(open_now),
                reason="stopping without waiting for the database any longer; its connections are closed here")
        self.is_cut = True
        for conn in open_now:
            sever(conn)
        for attempt in self._opening:
            attempt.cancel()
        return len(open_now)

    async def by(self, deadline: float, work: Awaitable[object]) -> bool:
        """Await ``work`` until ``deadline`` (the event loop's time): ``True`` if it ended by
        then (its exception, if any, raised). If the deadline comes first, cut, so the
        database work in it fails at once, and return ``False`` once it has ended."""
        task = asyncio.ensure_future(work)
        done, _ = await asyncio.wait([task], timeout=max(deadline - asyncio.get_running_loop().time(), 0.0))
        if done:
            task.result()
            return True
        await self.abandon(task)
        return False

    async def abandon(self, task: asyncio.Future[Any]) -> None:
        """Cut, then end ``task`` (database work nobody will wait for any longer)."""
        if self.cut():
            # Left a moment to fail on its own: cancelled while a statement still counts as
            # running, psycopg would ask the server to cancel it after all.
            await asyncio.wait([task], timeout=SETTLE_SECONDS)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
