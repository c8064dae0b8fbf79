"""Deliveries, failures and latency over a recent window, from the attempt history.

The one query the console's charts and rates are built from. Its cost is bounded by the
window, not by the history: ``occurred_at`` is both the index ``outbox_attempts_occurred_idx``
and, on PostgreSQL, the partition key (one partition per UTC day, outbox/partitions.py), so
a day's chart reads at most two partitions and an hour's only the index range of that hour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Integer, Select, and_, case, cast, func, or_, select, true
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql import ColumnElement

from outbox.schema import attempts

# Outcomes that were an answer (or the lack of one) from the receiver; "abandoned",
# "circuit_open" and "expired" rows record the daemon's decisions, not the endpoint's health.
DELIVERED = "success"
FAILED = ("failed", "timeout", "connection_error")


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
        conditions = []
        if self.tenant is not None:
            conditions.append(attempts.c.tenant_id == self.tenant)
        if self.origin is not None:  # attempt rows keep the URL without its query: match its origin
            conditions.append(or_(attempts.c.url == self.origin,
                                  attempts.c.url.startswith(self.origin + "/", autoescape=True)))
        return and_(true(), *conditions)


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


def _floor(dialect: str, value: ColumnElement[float]) -> ColumnElement[int]:
    """The whole part of a non-negative number (SQLite has no ``floor`` without its math extension)."""
    return func.floor(value) if dialect == "postgresql" else cast(value, Integer)


def bounds(window: Window, now: float) -> tuple[float, float]:
    """Where ``window`` starts and ends: whole buckets, the last one holding ``now``."""
    end = (now // window.bucket + 1) * window.bucket
    return end - window.seconds, end


def series_query(dialect: str, window: Window, scope: Scope, now: float) -> Select[Any]:
    """Per bucket index: deliveries, failures, average and slowest answer, over ``bounds``.

    Bounded by ``occurred_at`` on both sides, so PostgreSQL prunes to the window's partitions."""
    start, end = bounds(window, now)
    index = _floor(dialect, (attempts.c.occurred_at - start) / float(window.bucket)).label("i")
    answered = attempts.c.outcome.in_((DELIVERED, *FAILED))
    latency = case((answered, attempts.c.response_time_ms))
    return (select(index,
                   func.sum(case((attempts.c.outcome == DELIVERED, 1), else_=0)),
                   func.sum(case((attempts.c.outcome.in_(FAILED), 1), else_=0)),
                   func.avg(latency), func.max(latency))
            .where(attempts.c.occurred_at >= start, attempts.c.occurred_at < end, scope.condition())
            .group_by(index))


async def series(conn: AsyncConnection, window: Window, scope: Scope, now: float) -> Series:
    """``window``'s buckets ending with the one holding ``now`` (the database's time)."""
    start, _ = bounds(window, now)
    rows = await conn.execute(series_query(conn.dialect.name, window, scope, now))
    found = {int(i): (int(ok or 0), int(bad or 0), avg, peak) for i, ok, bad, avg, peak in rows}
    buckets = []
    for i in range(window.buckets):
        ok, bad, avg, peak = found.get(i, (0, 0, None, None))
        buckets.append(Bucket(start + i * window.bucket, ok, bad, None if avg is None else float(avg),
                              None if peak is None else int(peak)))
    return Series(window, tuple(buckets))


async def recent_totals(conn: AsyncConnection, seconds: float, scope: Scope, now: float) -> tuple[int, int, int]:
    """Deliveries, failures and the daemons that recorded them in the last ``seconds``
    (the health strip's rates, and whether any replica is delivering at all)."""
    query = (select(func.sum(case((attempts.c.outcome == DELIVERED, 1), else_=0)),
                    func.sum(case((attempts.c.outcome.in_(FAILED), 1), else_=0)),
                    func.count(attempts.c.daemon_id.distinct()))
             .where(attempts.c.occurred_at >= now - seconds, attempts.c.occurred_at <= now, scope.condition()))
    ok, bad, daemons = (await conn.execute(query)).one()
    return int(ok or 0), int(bad or 0), int(daemons or 0)
