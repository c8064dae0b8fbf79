"""Ending a background loop between its transactions, not inside one.

A task cancelled while its statement runs has SQLAlchemy discard the connection. On SQLite
(aiosqlite) the write lock stays with that discarded connection, and every later write waits
out the busy timeout (30 s): the daemon's stop, which writes (the outcomes it records, the
re-sealer leaving the readers), held ``outboxd run`` that long after a SIGTERM that landed
while the maintenance, jobs or re-sealer loop was in a statement. So the loops that write
are told to halt: each ends at its next pause, after the transaction under way; the daemon
cancels one only if it outlasts the time the stop allows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from supervisor.cycle.outage import OutageGuard, unless_stopped

T = TypeVar("T")

__all__ = ["Halt"]


class Halt:
    """One stop signal for the loops that write; each checks it between transactions."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        self._event.set()

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    async def pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or until halted."""
        try:
            await asyncio.wait_for(self._event.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def unless_halted(self, work: Coroutine[Any, Any, T]) -> T | None:
        """``work``'s result, or ``None`` when halted before it ends (``work`` then cancelled;
        never started when halted already). For what runs outside a transaction, such as an
        operator's event sink, which the stop need not wait for."""
        if self._event.is_set():
            work.close()
            return None
        return await unless_stopped(self._event, work)

    async def failed(self, outage: OutageGuard, doing: str, exc: BaseException) -> None:
        """The outage guard's wait after a failure (its back-off), cut short when halted. Unlike
        :meth:`unless_halted`, the guard runs even when halted already: the failure is still
        counted and logged (the database errors metric, a misconfiguration's critical line)."""
        await unless_stopped(self._event, outage.failed(doing, exc))
