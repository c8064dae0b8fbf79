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

from supervisor.cycle.outage import OutageGuard, unless_stopped

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

    @property
    def event(self) -> asyncio.Event:
        return self._event

    async def failed(self, outage: OutageGuard, doing: str, exc: BaseException) -> None:
        """The outage guard's wait after a failure (its back-off), cut short when halted."""
        await unless_stopped(self._event, outage.failed(doing, exc))
