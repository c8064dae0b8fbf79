"""How long the daemon tolerates an unreachable database before it gives up.

Short outages (a PostgreSQL restart, a failover) are ridden out with capped back-off; an
outage longer than ``OUTBOX_DATABASE_OUTAGE_SECONDS`` ends the process with a non-zero
status, so systemd or Kubernetes restarts it and the operator sees it. Leases make either
path safe: nothing in flight is lost, it is re-leased after expiry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog


class DatabaseUnavailable(RuntimeError):
    """The database stayed unreachable past the configured deadline."""


class OutageGuard:
    def __init__(self, deadline_seconds: float, on_outage: Callable[[], None] | None = None) -> None:
        self._deadline = deadline_seconds
        self._on_outage = on_outage  # called once when an outage begins (the metric)
        self._since: float | None = None
        self._failures = 0
        self._log = structlog.get_logger("outboxd.database")
        self.recovered = asyncio.Event()  # set when an outage ends (the clock re-measures)

    def ok(self) -> None:
        if self._since is not None:
            self._log.info("database.recovered", outage_seconds=round(time.monotonic() - self._since, 2))
            self.recovered.set()
        self._since, self._failures = None, 0

    async def failed(self, doing: str, exc: BaseException) -> None:
        """Note a failure and wait before the caller retries; raise past the deadline."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
            if self._on_outage is not None:
                self._on_outage()
        self._failures += 1
        elapsed = now - self._since
        if elapsed > self._deadline:
            self._log.critical("database.unreachable", doing=doing, outage_seconds=round(elapsed, 1),
                               error=type(exc).__name__)
            raise DatabaseUnavailable(f"database unreachable for {elapsed:.0f} s (while trying to {doing})") from exc
        if self._failures == 1 or self._failures % 10 == 0:
            self._log.error("database.error", doing=doing, error=type(exc).__name__, detail=str(exc)[:200],
                            outage_seconds=round(elapsed, 1))
        await asyncio.sleep(min(0.2 * 2 ** min(self._failures - 1, 5), 5.0))
