"""The signing clock: the database's time, carried forward on the host's monotonic clock.

Leases, horizons and retry times are all database time (``outbox.store``), so the RFC 9421
``created``/``expires`` and the legacy HMAC timestamp must be too: a host clock a minute
off would otherwise make every signature fail at every receiver, terminally
(``signature_rejected``). The daemon measures the offset when it starts and whenever the
database comes back after an outage, and re-checks it every :data:`RECHECK_SECONDS`.

An offset beyond :data:`MAX_OFFSET_SECONDS` means one of the two clocks is wrong by more
than receivers tolerate, and the daemon cannot tell which, so it refuses to run: AdCP
verifiers reject a signature whose ``created`` is more than 60 s in their future or whose
``expires`` is more than 60 s in their past (the verifier checklist webhooks follow,
https://adcontextprotocol.org/docs/building/implementation/security#verifier-checklist-requests;
the adcp SDK's ``DEFAULT_SKEW_SECONDS``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import store
from outbox.errors import ConfigurationError
from supervisor.cycle.outage import OutageGuard

MAX_OFFSET_SECONDS = 60.0  # receivers' allowed clock skew
SAMPLES = 3  # round trips per measurement; the shortest bounds the error best
MEASURING = "measure the clock offset"  # the outage guard's name for this activity
RECHECK_SECONDS = 600.0  # clocks drift and NTP steps them, outages or not


class ClockOffsetError(ConfigurationError):
    """The host and database clocks disagree by more than receivers tolerate."""


class DatabaseClock:
    """The database's time now; call it for "now".

    Counted on the monotonic clock from the last measurement (the database's time at the
    midpoint of its quickest round trip), so a step of the host clock between measurements
    (NTP stepping it, a VM resumed) moves no signature; before the first measurement, the
    host clock. ``offset`` (database minus host) is what the skew check judges.
    """

    def __init__(self, host: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._host = host
        self._monotonic = monotonic
        self.offset = 0.0  # database minus host, seconds
        self.error = 0.0  # half the round trip of the sample the offset came from
        self._anchor: tuple[float, float] | None = None  # (monotonic, database time) at the measurement
        self._log = structlog.get_logger("outboxd.clock")

    def __call__(self) -> float:
        if self._anchor is None:
            return self._host() + self.offset
        at, database = self._anchor
        return database + (self._monotonic() - at)

    async def measure(self, engine: AsyncEngine) -> float:
        """Measure the offset (NTP-style midpoint of the quickest round trip) and adopt it.

        Raises :class:`ClockOffsetError` (one line) when it is beyond what receivers
        tolerate; the previous offset then stays in place.
        """
        best: tuple[float, float, float, float] | None = None  # (round trip, offset, monotonic, database)
        async with engine.connect() as conn:
            for _ in range(SAMPLES):
                sent, sent_at = self._host(), self._monotonic()
                database = await store.db_now(conn)
                received, received_at = self._host(), self._monotonic()
                sample = (received_at - sent_at, database - (sent + received) / 2, (sent_at + received_at) / 2,
                          database)
                best = sample if best is None or sample[0] < best[0] else best
        assert best is not None
        round_trip, offset, at, database = best
        if abs(offset) > MAX_OFFSET_SECONDS:
            raise ClockOffsetError(
                f"the host clock is {abs(offset):.1f} s {'behind' if offset > 0 else 'ahead of'} the database clock, "
                f"beyond the {MAX_OFFSET_SECONDS:.0f} s skew AdCP receivers tolerate: fix time sync (NTP) on the "
                "host or the database"
            )
        self.offset, self.error, self._anchor = offset, round_trip / 2, (at, database)
        self._log.info("clock.measured", offset_seconds=round(offset, 3), error_seconds=round(self.error, 3))
        return offset

    async def watch(self, engine: AsyncEngine, outage: OutageGuard) -> None:
        """Re-measure after every database outage and every ``RECHECK_SECONDS``; raise if off.

        A measurement the database fails is reported to the outage guard (which decides when
        to give up); a clock beyond tolerance ends the daemon through ClockOffsetError.
        """
        while True:
            try:
                await asyncio.wait_for(outage.recovered.wait(), RECHECK_SECONDS)
            except TimeoutError:
                pass
            outage.recovered.clear()
            while True:  # until measured: a failing measurement is itself part of the outage
                try:
                    await self.measure(engine)
                    outage.ok(MEASURING)
                    break
                except (SQLAlchemyError, OSError) as exc:
                    await outage.failed(MEASURING, exc)
