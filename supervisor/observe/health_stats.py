"""Endpoint health: success rate, latency, attempts and deaths per tenant and origin.

Reading health from ``outbox_attempts`` would cost a scan of the window's attempt rows
(millions an hour on a busy seller). Instead the completer adds what each flush recorded
to a per-minute rollup (``outbox_endpoint_stats``) in the flush's own transaction, so the
rollup is exactly as durable as the attempt rows it counts: one upsert per flush, one row
per endpoint, minute and daemon (a replica never waits on another's row). A window's
health is the sum of its rows; latency quantiles come from a fixed histogram
(:data:`outbox.schema.LATENCY_BOUNDS_MS`). See docs/observability.md.

The console's charts and rates read the same rows (:mod:`supervisor.ui.timeseries`): each
row also counts the failures the charts draw and keeps the minute's slowest answer.

:func:`endpoint_health` is the read side, shared by ``outboxd endpoints``, the console and
the optional Prometheus series (``EndpointHealth.as_dict`` is its JSON form).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import and_, delete, func, select, text, true, tuple_
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox.breaker_rows import state_now
from outbox.schema import LATENCY_BOUNDS_MS, PG_NOW, SQLITE_NOW, breakers, endpoint_stats
from outbox.store import json_rows
from outbox.activity import rfc3339

BUCKETS = len(LATENCY_BOUNDS_MS) + 1
HISTOGRAM = tuple(f"le_{i}" for i in range(BUCKETS))
COUNTS = ("attempts", "successes", "deaths", "failures", "latency_ms_sum", *HISTOGRAM)
# The longest window `outboxd endpoints` can show.
RETENTION_SECONDS = 86_400
# How long minutes are kept: an hour beyond that, since the console's day chart starts at the
# top of the hour a day before the current one ends.
KEPT_SECONDS = RETENTION_SECONDS + 3600
# Attempt outcomes that were the receiver's answer (or the lack of one): success, and the
# failures. "abandoned" (interrupted at shutdown) is the daemon's own decision, counted in
# ``attempts`` only. Only these carry a response time into the rollup.
DELIVERED = "success"
FAILED = ("failed", "timeout", "connection_error")
PRUNE_LIMIT = 5_000  # rows deleted per maintenance pass


@dataclass(frozen=True)
class Recorded:
    """One outcome the completer recorded, as endpoint health counts it."""

    tenant_id: str
    origin: str
    attempted: bool  # an attempt row was written
    succeeded: bool  # answered 2xx
    latency_ms: int | None  # None unless the receiver answered (or timed out, or refused)
    died: bool  # the message ended dead
    failed: bool = False  # an attempt that failed at the receiver (an outcome in FAILED)

    @classmethod
    def of(cls, tenant_id: str, origin: str, outcome: str | None, latency_ms: int | None,
           died: bool) -> "Recorded":
        """What an attempt of ``outcome`` counts (``None``: no attempt row was written): the
        one place the rollup's, and so the console's, definitions are made."""
        answered = outcome == DELIVERED or outcome in FAILED
        return cls(tenant_id, origin, outcome is not None, outcome == DELIVERED,
                   latency_ms if answered else None, died, outcome in FAILED)


def bucket_of(latency_ms: int) -> int:
    """The histogram column an attempt of ``latency_ms`` is counted in."""
    for i, bound in enumerate(LATENCY_BOUNDS_MS):
        if latency_ms <= bound:
            return i
    return len(LATENCY_BOUNDS_MS)


def tally(recorded: Iterable[Recorded], *, now: float, daemon_id: str) -> list[dict[str, Any]]:
    """One rollup row per endpoint for a flush at ``now``, in key order (so two flushes
    touching the same rows lock them in the same order)."""
    minute = int(now // 60)
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in recorded:
        row = rows.get((r.tenant_id, r.origin))
        if row is None:
            row = rows[(r.tenant_id, r.origin)] = {"minute": minute, "tenant_id": r.tenant_id, "origin": r.origin,
                                                   "daemon_id": daemon_id, **dict.fromkeys(COUNTS, 0),
                                                   "latency_ms_max": 0}
        row["attempts"] += r.attempted
        row["successes"] += r.succeeded
        row["deaths"] += r.died
        row["failures"] += r.failed
        if r.latency_ms is not None:
            row["latency_ms_sum"] += r.latency_ms
            row["latency_ms_max"] = max(row["latency_ms_max"], r.latency_ms)
            row[HISTOGRAM[bucket_of(r.latency_ms)]] += 1
    return [rows[key] for key in sorted(rows)]


def _upsert_sql(pg: bool) -> Any:
    """Add rows to their minute's counts, keeping the slower of the two maxima: one statement
    per flush, whatever its size."""
    kinds = {"tenant_id": "text", "origin": "text", "daemon_id": "text"}
    columns = ["minute", *kinds, *COUNTS, "latency_ms_max"]
    source = json_rows(pg, [(c, kinds.get(c, "int")) for c in columns])
    greatest = "GREATEST" if pg else "MAX"  # SQLite's max() of two arguments is the scalar one
    added = ", ".join([*(f"{c} = outbox_endpoint_stats.{c} + excluded.{c}" for c in COUNTS),
                       f"latency_ms_max = {greatest}(outbox_endpoint_stats.latency_ms_max, excluded.latency_ms_max)"])
    listed = ", ".join(columns)
    # WHERE true: SQLite needs it to parse ON CONFLICT after INSERT ... SELECT.
    return text(f"INSERT INTO outbox_endpoint_stats ({listed}) SELECT {listed} FROM {source} WHERE true "
                f"ON CONFLICT (minute, tenant_id, origin, daemon_id) DO UPDATE SET {added}")


_UPSERT = {True: _upsert_sql(True), False: _upsert_sql(False)}  # kept: supervisor/cycle/pgdirect.py caches by identity


def upsert(dialect: str) -> Any:
    """The statement :func:`record` runs, bound as ``rows`` (the JSON of :func:`tally`'s rows)."""
    return _UPSERT[dialect == "postgresql"]


async def record(conn: AsyncConnection, rows: Sequence[dict[str, Any]]) -> None:
    """Add :func:`tally`'s rows to the rollup (in the caller's transaction)."""
    if rows:
        await conn.execute(upsert(conn.dialect.name), {"rows": json.dumps(rows)})


def _minute(conn: AsyncConnection, seconds_ago: int) -> Any:
    """The database's minute number (as :func:`tally` counts) ``seconds_ago`` before now."""
    if conn.dialect.name == "postgresql":
        return text(f"CAST(floor(({PG_NOW} - {seconds_ago}) / 60) AS BIGINT)")
    return text(f"CAST(({SQLITE_NOW} - {seconds_ago}) / 60 AS INTEGER)")  # truncates: floor for epoch times


async def prune(conn: AsyncConnection, *, limit: int = PRUNE_LIMIT) -> int:
    """Delete one batch of minutes older than :data:`KEPT_SECONDS`; how many rows went."""
    oldest = _minute(conn, KEPT_SECONDS)
    doomed = select(endpoint_stats.c.minute, endpoint_stats.c.tenant_id, endpoint_stats.c.origin,
                    endpoint_stats.c.daemon_id).where(endpoint_stats.c.minute < oldest).limit(limit)
    keys = [tuple(r) for r in await conn.execute(doomed)]
    if not keys:
        return 0
    pk = (endpoint_stats.c.minute, endpoint_stats.c.tenant_id, endpoint_stats.c.origin, endpoint_stats.c.daemon_id)
    result = await conn.execute(delete(endpoint_stats).where(tuple_(*pk).in_(keys)))
    return int(result.rowcount or 0)


def quantile(histogram: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile (ms) of a latency histogram, interpolated inside its bucket.

    ``None`` with no latency recorded; in the open last bucket, its lower bound (the true
    value is at least that).
    """
    total = sum(histogram)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, count in enumerate(histogram):
        if count and seen + count >= rank:
            low = 0 if i == 0 else LATENCY_BOUNDS_MS[i - 1]
            if i == len(LATENCY_BOUNDS_MS):
                return float(low)
            return low + (LATENCY_BOUNDS_MS[i] - low) * (rank - seen) / count
        seen += count
    return float(LATENCY_BOUNDS_MS[-1])


@dataclass(frozen=True)
class EndpointHealth:
    """One endpoint's health over a window (``window_seconds`` up to the database's now)."""

    tenant_id: str
    origin: str
    window_seconds: int
    attempts: int
    successes: int
    deaths: int
    success_rate: float | None  # successes / attempts; None without attempts
    latency_p50_ms: float | None
    latency_p95_ms: float | None
    latency_mean_ms: float | None
    breaker_state: str  # closed | open | half_open (closed: no breaker row)
    breaker_open_until: float | None
    breaker_trips: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the breaker's open time as RFC 3339, like every time ``outboxd`` prints."""
        return {**asdict(self), "breaker_open_until": rfc3339(self.breaker_open_until)}


async def endpoint_health(conn: AsyncConnection, *, window_seconds: float = 3600, tenant: str | None = None,
                          origin: str | None = None, limit: int | None = None,
                          endpoints: Sequence[tuple[str, str]] | None = None) -> list[EndpointHealth]:
    """Health of every endpoint with traffic in the window or a breaker not closed, busiest
    first (at most ``limit``); only the given ``endpoints`` (tenant, origin pairs) when set,
    as for a page that lists some. Reads the window's rollup rows (endpoints × minutes ×
    daemons) and the breakers of the endpoints shown: never the attempt history.

    Minutes are whole: a window of N minutes covers the current minute and the N-1 before it.
    """
    if not 60 <= window_seconds <= RETENTION_SECONDS:
        raise ValueError(f"window must be between 1 minute and {RETENTION_SECONDS // 3600} hours")
    if endpoints is not None and not endpoints:
        return []
    s = endpoint_stats.c
    first = _minute(conn, (int(window_seconds // 60) - 1) * 60)
    chosen = [] if endpoints is None else [list(endpoints)]
    scope = and_(true(), *([s.tenant_id == tenant] if tenant else []), *([s.origin == origin] if origin else []),
                 *(tuple_(s.tenant_id, s.origin).in_(keys) for keys in chosen))
    sums = [func.sum(getattr(s, c)).label(c) for c in COUNTS]
    query = (select(s.tenant_id, s.origin, *sums).where(s.minute >= first, scope)
             .group_by(s.tenant_id, s.origin))
    totals = {(r.tenant_id, r.origin): r for r in await conn.execute(query)}
    b = breakers.c
    bscope = and_(true(), *([b.tenant_id == tenant] if tenant else []), *([b.origin == origin] if origin else []),
                  *(tuple_(b.tenant_id, b.origin).in_(keys) for keys in chosen))
    columns = (b.tenant_id, b.origin, state_now(conn), b.open_until, b.trips)
    # Endpoints with an open or half-open breaker are shown even without traffic in the window.
    breaker_rows = {(r.tenant_id, r.origin): r for r in await conn.execute(
        select(*columns).where(bscope, b.state != "closed"))}
    keys = sorted(totals)
    for i in range(0, len(keys), 500):  # the (closed) breakers of the endpoints with traffic
        chunk = select(*columns).where(tuple_(b.tenant_id, b.origin).in_(keys[i:i + 500]))
        breaker_rows.update({(r.tenant_id, r.origin): r for r in await conn.execute(chunk)})
    shown = list(set(totals) | set(breaker_rows))
    shown.sort(key=lambda k: (-(int(totals[k].attempts) if k in totals else 0), k))
    return [_health(key, totals.get(key), breaker_rows.get(key), int(window_seconds // 60) * 60)
            for key in shown[:limit]]


def _health(key: tuple[str, str], total: Any, breaker: Any, window_seconds: int) -> EndpointHealth:
    counts = {c: int(getattr(total, c) or 0) if total is not None else 0 for c in COUNTS}
    histogram = [counts[c] for c in HISTOGRAM]
    timed = sum(histogram)
    attempts = counts["attempts"]
    return EndpointHealth(
        tenant_id=key[0], origin=key[1], window_seconds=window_seconds, attempts=attempts,
        successes=counts["successes"], deaths=counts["deaths"],
        success_rate=counts["successes"] / attempts if attempts else None,
        latency_p50_ms=quantile(histogram, 0.5), latency_p95_ms=quantile(histogram, 0.95),
        latency_mean_ms=counts["latency_ms_sum"] / timed if timed else None,
        breaker_state=breaker.state if breaker is not None else "closed",
        breaker_open_until=breaker.open_until if breaker is not None else None,
        breaker_trips=int(breaker.trips) if breaker is not None else 0,
    )
