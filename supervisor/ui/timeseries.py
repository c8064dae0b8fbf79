"""Deliveries, failures and latency over a recent window, from the endpoint-health rollup.

The queries the console's charts and rates are built from. They read ``outbox_endpoint_stats``
(per minute, endpoint and daemon: what the completer recorded in the flush that wrote the
attempt rows, :mod:`supervisor.observe.health_stats`), never ``outbox_attempts``: a chart costs
endpoints × minutes in its window, whatever the traffic: everyone's window is a range of the
rollup's primary key (which starts with the minute), a tenant's or an endpoint's a range of
its index by tenant, origin and minute. docs/console.md "The charts".

What is counted is :class:`supervisor.observe.health_stats.Recorded`'s definition: delivered =
``success``; failed = ``failed``, ``timeout``, ``connection_error`` (not the daemon's own
``abandoned``); latency over those answered attempts that have a response time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, and_, case, func, or_, select, true
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql import ColumnElement

from outbox.schema import attempts, endpoint_stats
from supervisor.observe.health_stats import HISTOGRAM


@dataclass(frozen=True)
class Window:
    """A chart's span and bucket width, in seconds."""

    name: str
    seconds: int
    bucket: int

    @property
    def buckets(self) -> int:
        return self.seconds // self.bucket


HOUR = Window("hour", 3600, 60)
DAY = Window("day", 86400, 3600)


@dataclass(frozen=True)
class Scope:
    """Whose attempts: everyone's, a tenant's, or one endpoint's (tenant and origin)."""

    tenant: str | None = None
    origin: str | None = None  # scheme://authority; needs a tenant

    def condition(self) -> ColumnElement[bool]:
        """The scope's attempt rows (for lists of attempts, not for counting them)."""
        conditions = []
        if self.tenant is not None:
            conditions.append(attempts.c.tenant_id == self.tenant)
        if self.origin is not None:  # attempt rows keep the URL without its query: match its origin
            conditions.append(or_(attempts.c.url == self.origin,
                                  attempts.c.url.startswith(self.origin + "/", autoescape=True)))
        return and_(true(), *conditions)

    def rollup(self) -> ColumnElement[bool]:
        """The scope's rollup rows."""
        s = endpoint_stats.c
        return and_(true(), *([s.tenant_id == self.tenant] if self.tenant is not None else []),
                    *([s.origin == self.origin] if self.origin is not None else []))


@dataclass(frozen=True)
class Bucket:
    """One bucket of a series: when it starts (epoch seconds) and what happened in it."""

    start: float
    delivered: int = 0
    failed: int = 0
    latency_avg_ms: float | None = None
    latency_max_ms: int | None = None

    @property
    def attempts(self) -> int:
        return self.delivered + self.failed


@dataclass(frozen=True)
class Series:
    """A window's buckets, oldest first; the last one is still filling."""

    window: Window
    buckets: tuple[Bucket, ...]

    @property
    def delivered(self) -> int:
        return sum(b.delivered for b in self.buckets)

    @property
    def failed(self) -> int:
        return sum(b.failed for b in self.buckets)


def bounds(window: Window, now: float) -> tuple[float, float]:
    """Where ``window`` starts and ends: whole buckets, the last one holding ``now``."""
    end = (now // window.bucket + 1) * window.bucket
    return end - window.seconds, end


def _timed() -> ColumnElement[int]:
    """A rollup row's attempts with a response time (its histogram's total)."""
    total: Any = getattr(endpoint_stats.c, HISTOGRAM[0])
    for column in HISTOGRAM[1:]:
        total = total + getattr(endpoint_stats.c, column)
    return total


def series_query(window: Window, scope: Scope, now: float) -> Select[Any]:
    """Per bucket index: deliveries, failures, latency total, timed attempts and the slowest
    answer, over ``bounds``' minutes (a bucket is a whole number of minutes)."""
    start, end = bounds(window, now)
    s = endpoint_stats.c
    first = int(start // 60)
    index = ((s.minute - first) // (window.bucket // 60)).label("i")
    return (select(index, func.sum(s.successes), func.sum(s.failures), func.sum(s.latency_ms_sum),
                   func.sum(_timed()), func.max(s.latency_ms_max))
            .where(s.minute >= first, s.minute < int(end // 60), scope.rollup())
            .group_by(index))


async def series(conn: AsyncConnection, window: Window, scope: Scope, now: float) -> Series:
    """``window``'s buckets ending with the one holding ``now`` (the database's time)."""
    start, _ = bounds(window, now)
    found = {int(i): (int(ok or 0), int(bad or 0), int(total or 0), int(timed or 0), int(peak or 0))
             for i, ok, bad, total, timed, peak in await conn.execute(series_query(window, scope, now))}
    buckets = []
    for i in range(window.buckets):
        ok, bad, total, timed, peak = found.get(i, (0, 0, 0, 0, 0))
        buckets.append(Bucket(start + i * window.bucket, ok, bad, total / timed if timed else None,
                              peak if timed else None))
    return Series(window, tuple(buckets))


@dataclass(frozen=True)
class Totals:
    """What the rollup holds for the last minutes: the health strip's rates."""

    delivered: int
    failed: int
    daemons: int  # distinct daemons that recorded an attempt
    seconds: float  # the span counted: the whole minutes asked for, and the current one so far

    def per_minute(self, count: int) -> float:
        """``count`` as a rate over the span counted (not the span asked for: it can be longer)."""
        return count * 60 / self.seconds


async def recent_totals(conn: AsyncConnection, seconds: int, scope: Scope, now: float) -> Totals:
    """Deliveries, failures and the daemons that recorded them over the last ``seconds``
    (the health strip's rates, and whether any replica is delivering at all).

    The rollup counts whole minutes, so the span is the ``seconds // 60`` minutes before the
    current one plus the current one so far: every attempt of the last ``seconds`` is counted,
    with up to a minute more, and a rate divides by the span actually counted."""
    s = endpoint_stats.c
    current = int(now // 60)
    query = (select(func.sum(s.successes), func.sum(s.failures),
                    func.count(case((s.attempts > 0, s.daemon_id)).distinct()))
             .where(s.minute >= current - seconds // 60, s.minute <= current, scope.rollup()))
    ok, bad, daemons = (await conn.execute(query)).one()
    return Totals(int(ok or 0), int(bad or 0), int(daemons or 0), seconds // 60 * 60 + now % 60)
