"""Background upkeep: rescue crashed daemons' leases, expire what is past its horizon,
sample the gauges that need a query, prune endpoint health past its retention
(:mod:`supervisor.observe.health_stats`), publish operator events (:mod:`supervisor.observe.events`), and
(PostgreSQL) keep the attempt partitions of the coming days ready (:mod:`outbox.partitions`)
and vacuum the claim's small due tables once they hold dead rows (:func:`vacuum_due_tables`).

Rescue writes an ``abandoned`` attempt row for every lease it takes back, so an attempt
cut short by a crash (after which the receiver may or may not have seen the request) is
still in the attempt log. The gauges are sampled every ``GAUGE_INTERVAL`` seconds per
process, never per scrape, so scrapes put no load on the database.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import structlog
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from outbox import store
from outbox.claim_sql import DUE_TABLES
from outbox.config import Settings
from outbox.partitions import ensure_attempt_partitions
from outbox.breaker_rows import holding_back, state_now
from outbox.urls import public_url
from sinks.attempt import DeliveryAttempt
from supervisor.cycle import challenge
from supervisor.observe import events, health_stats
from supervisor.cycle.halting import Halt
from supervisor.observe.metrics import ENDPOINT_WINDOW_SECONDS, Metrics
from supervisor.cycle.outage import OutageGuard

RESCUE_INTERVAL = 2.0
EXPIRE_INTERVAL = 30.0
GAUGE_INTERVAL = 15.0
PARTITION_INTERVAL = 3600.0
PRUNE_INTERVAL = 60.0
DUE_VACUUM_DEAD_ROWS = 1_000  # dead rows a due table may hold before this daemon vacuums it
# Past this size a vacuum also gives the empty end of the table back: that takes the table's
# strongest lock for a moment, so producers' inserts wait; below it, vacuumed pages are reused.
DUE_TRUNCATE_BYTES = 1 << 20


MAX_ELAPSED_MS = 2**31 - 1  # what the attempt row's integer holds: about 24.8 days


def _elapsed_ms(seconds: float) -> int:
    """An abandoned attempt's time from its lease's start to its rescue, as the row stores it:
    a lease that ran out weeks before any daemon came back is held at the column's limit."""
    return min(max(round(seconds * 1000), 0), MAX_ELAPSED_MS)


async def rescue_once(engine: AsyncEngine, daemon_id: str, lease_seconds: float) -> int:
    """Hand back the leases that ran out, each recorded as an ``abandoned`` attempt from its
    lease's start (so ``webhook_activity`` gives when that attempt fired) to now."""
    async with engine.begin() as conn:
        rows = await store.rescue_expired_leases(conn)
        if not rows:
            return 0
        now = await store.db_now(conn)
        await store.insert_attempts(conn, [
            DeliveryAttempt(
                message_id=r.id, tenant_id=r.tenant_id, url=public_url(r.url), attempt_number=r.attempts,
                outcome="abandoned", http_status_code=None,
                error_message=f"lease of daemon {r.leased_by} expired; outcome unknown"[:200],
                response_time_ms=_elapsed_ms(now - r.started_at(lease_seconds)),
                will_retry=True, next_retry_at=now, payload_size_bytes=r.payload_size,
                sequence_number=r.sequence_number, idempotency_key=r.idempotency_key,
                notification_type=r.notification_type, trigger=r.trigger, daemon_id=daemon_id, occurred_at=now,
            ).as_row()
            for r in rows
        ])
    return len(rows)


async def record_deaths(conn: AsyncConnection, rows: Sequence[Any], reason: str, *, daemon_id: str,
                        window: float) -> challenge.Settled:
    """Settle what ended dead without an attempt (past its horizon, cancelled by a recovery
    job), in the same transaction: a URL proof among them fails, and the endpoint-health
    rollup (its deaths) and the operator events count them. ``rows``: (id, tenant_id, origin)."""
    settled = await challenge.settle(conn, [], [r.id for r in rows])
    now = await store.db_now(conn)
    await health_stats.record(conn, health_stats.tally(
        (health_stats.Recorded.of(r.tenant_id, r.origin, None, None, True) for r in rows if r.origin),
        now=now, daemon_id=daemon_id))
    await events.messages_ended(conn, [(r.tenant_id, r.origin, reason) for r in rows], now=now, window=window)
    return settled


def count_deaths(metrics: Metrics, settled: challenge.Settled | None, rows: Sequence[Any], reason: str) -> None:
    """After the commit of :func:`record_deaths`: the dead-letter and final-outcome counters."""
    if settled is not None:
        settled.count(metrics)
    for row in rows:
        metrics.count_dead(reason, row.tenant_id)


async def sample_gauges(engine: AsyncEngine, metrics: Metrics) -> None:
    """Live rows only, from their partial indexes: the cost is what is due, not history."""
    async with engine.connect() as conn:
        pending, in_flight = await store.live_counts(conn)
        oldest, now = await store.next_due_at(conn)
        unheld, _ = await store.oldest_unheld_due(conn)
        state = state_now(conn)
        states: dict[str, int] = dict((await conn.execute(select(state, func.count()).group_by(state))).all())
        held_back = await holding_back(conn)
        if metrics.endpoint_top:
            metrics.set_endpoints(await health_stats.endpoint_health(
                conn, window_seconds=ENDPOINT_WINDOW_SECONDS, limit=metrics.endpoint_top))
    metrics.messages.labels(state="pending").set(pending)
    metrics.messages.labels(state="in_flight").set(in_flight)
    metrics.oldest_due_age.set(max(now - oldest, 0.0) if oldest is not None else 0.0)
    metrics.delivery_lag.set(max(now - unheld, 0.0) if unheld is not None else 0.0)
    for name in ("closed", "open", "half_open"):
        metrics.breakers.labels(state=name).set(states.get(name, 0))
    metrics.breakers_holding_back.set(held_back)


async def vacuum_due_tables(engine: AsyncEngine, dead_rows: int = DUE_VACUUM_DEAD_ROWS,
                            truncate_bytes: int = DUE_TRUNCATE_BYTES) -> list[str]:
    """Vacuum each due table holding at least ``dead_rows`` dead rows (by PostgreSQL's
    statistics) that this role owns, shortening those over ``truncate_bytes``; the names
    vacuumed.

    Every claim reads the three whole (docs/architecture.md, "Claiming ahead"): the fold
    deletes every arrival, and the write-back finds its rows by ``ctid``. Their reads cost
    what the tables hold, live or dead, and a burst leaves a trace: a commit of 1,000,000
    messages appends as many arrivals, whose 8,334 pages every later fold scanned (12 ms
    each, against 0.2-0.3 ms after a vacuum) until a vacuum came; autovacuum comes a minute
    later at best (``autovacuum_naptime``), and may be off. Vacuuming here keeps them to what
    is live within seconds. ``SKIP_LOCKED``: a table another vacuum holds is left to it. A
    table is shortened only past ``truncate_bytes`` (after a burst), so the vacuums of
    steady traffic never take the lock producers' inserts would wait on; one it cannot
    shorten for lack of a moment without writers (PostgreSQL tries for up to 5 s) is tried
    again later (docs/performance.md, "A burst's trace in the due tables")."""
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")  # VACUUM runs outside a transaction
        rows = (await conn.execute(text("""
            SELECT s.relid::regclass::text AS name, pg_relation_size(s.relid) > :truncate AS shorten
            FROM pg_stat_user_tables AS s JOIN pg_class AS c ON c.oid = s.relid
            WHERE s.relid IN (SELECT to_regclass(name) FROM unnest(CAST(:tables AS text[])) AS name)
              AND s.n_dead_tup >= :dead AND pg_has_role(c.relowner, 'USAGE')
            ORDER BY 1
        """), {"tables": list(DUE_TABLES), "dead": dead_rows, "truncate": truncate_bytes})).all()
        for name, shorten in rows:  # a regclass's text: the table's name, quoted where it needs to be
            await conn.execute(text(f"VACUUM (SKIP_LOCKED, TRUNCATE {'true' if shorten else 'false'}) {name}"))
    return [name for name, _ in rows]


class Maintenance:
    def __init__(self, engine: AsyncEngine, *, daemon_id: str, metrics: Metrics, outage: OutageGuard,
                 horizon_seconds: int, settings: Settings | None = None, event_sinks: Sequence[events.Sink] = (),
                 halt: Halt | None = None) -> None:
        self._engine = engine
        self._halt = halt or Halt()  # the daemon's stop (supervisor/cycle/halting.py)
        self._settings = settings or Settings()  # the operator events' destination and window
        self._event_sinks = event_sinks
        self._horizon = horizon_seconds
        self._daemon_id = daemon_id
        self._metrics = metrics
        self._outage = outage
        self._postgresql = engine.dialect.name == "postgresql"  # SQLite: one attempts table, no due tables
        self._log = structlog.get_logger("outboxd.maintenance")
        self._vacuuming: asyncio.Task[None] | None = None

    def _vacuum_soon(self) -> None:
        """Vacuum the due tables beside the tick, one vacuum at a time: shortening a table
        can take PostgreSQL seconds, which must not delay the lease rescue."""
        if self._postgresql and (self._vacuuming is None or self._vacuuming.done()):
            self._vacuuming = asyncio.create_task(self._vacuum_due_tables())

    async def _vacuum_due_tables(self) -> None:
        """Upkeep that delivery does not wait on: a failure is logged, never an outage."""
        try:
            vacuumed = await vacuum_due_tables(self._engine)
        except Exception as exc:
            self._log.warning("due_tables.vacuum_failed", error=type(exc).__name__,
                              detail=(str(exc).splitlines() or [""])[0][:200])
            return
        if vacuumed:
            self._log.debug("due_tables.vacuumed", tables=vacuumed)

    async def run(self) -> None:
        try:
            await self._tick_forever()
        finally:
            if self._vacuuming is not None:
                self._vacuuming.cancel()
                await asyncio.gather(self._vacuuming, return_exceptions=True)

    async def _tick_forever(self) -> None:
        ticks = 0
        while not self._halt.is_set:
            try:
                rescued = await rescue_once(self._engine, self._daemon_id, self._settings.lease_seconds)
                if rescued:
                    self._metrics.lease_rescues.inc(rescued)
                    self._log.warning("leases.rescued", count=rescued)
                if ticks % int(EXPIRE_INTERVAL / RESCUE_INTERVAL) == 0:
                    async with self._engine.begin() as conn:
                        expired = await store.expire_past_horizon(conn, horizon_seconds=self._horizon)
                        # most ticks expire nothing: no further statement then
                        settled = await record_deaths(conn, expired, "expired", daemon_id=self._daemon_id,
                                                      window=self._settings.operator_events_window_seconds) \
                            if expired else None
                    count_deaths(self._metrics, settled, expired, "expired")  # after the commit
                    if expired:
                        self._log.warning("messages.expired", count=len(expired))
                if ticks % int(GAUGE_INTERVAL / RESCUE_INTERVAL) == 0:
                    await sample_gauges(self._engine, self._metrics)
                if ticks % int(PRUNE_INTERVAL / RESCUE_INTERVAL) == 0:
                    async with self._engine.begin() as conn:
                        await health_stats.prune(conn)
                        await events.keys_leaving(conn, await store.db_now(conn))
                self._vacuum_soon()
                if ticks % int(PARTITION_INTERVAL / RESCUE_INTERVAL) == 0 and self._postgresql:
                    created = await ensure_attempt_partitions(self._engine)
                    if created:
                        self._log.info("attempt_partitions.created", count=created)
                await events.publish_due(self._engine, self._settings, self._event_sinks,
                                         self._settings.sink_timeout_seconds, within=self._halt.unless_halted)
                self._outage.ok("maintenance")
            except Exception as exc:
                await self._halt.failed(self._outage, "maintenance", exc)
                continue
            ticks += 1
            await self._halt.pause(RESCUE_INTERVAL)
