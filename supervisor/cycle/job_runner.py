"""The daemon's side of recovery jobs (supervisor/operator/jobs.py makes and shows them): take
a running job no live daemon holds and run it chunk by chunk, each chunk one transaction that
replays (or cancels) the next messages by id, records them in ``outbox_job_items`` and
advances the job's cursor and counts, at most the job's rate. Messages a cancel job ends
count as deaths, as expiries do (:func:`supervisor.cycle.maintenance.record_deaths`).
"""

from __future__ import annotations

from typing import Any

import structlog
from sqlalchemy import insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from outbox import store
from outbox.config import Settings
from outbox.schema import PG_NOW, SQLITE_NOW, job_items, jobs, messages
from outbox.schema import db_now as db_clock
from supervisor.cycle.halting import Halt
from supervisor.cycle.maintenance import count_deaths, record_deaths
from supervisor.cycle.outage import OutageGuard
from supervisor.observe.metrics import Metrics
from supervisor.operator.jobs import CHUNK, LEASE_SECONDS, Selection

IDLE_SECONDS = 1.0
EVENTS_WINDOW_SECONDS = Settings().operator_events_window_seconds  # a runner told nothing else


async def _cancel(conn: AsyncConnection, job_id: int, ids: list[int]) -> list[Any]:
    """End those of ``ids`` still pending as dead ``cancelled`` (their id, tenant and origin);
    one leased in flight is left alone."""
    m = messages.c
    ended = await conn.execute(update(messages).where(m.id.in_(ids), m.state == "pending").values(
        held=False, state="dead", dead_reason="cancelled", finished_at=db_clock(),
        last_error=f"cancelled by recovery job {job_id}").returning(m.id, m.tenant_id, m.origin))
    return sorted(ended, key=lambda row: row.id)


async def run_chunk(engine: AsyncEngine, job_id: int, *, daemon_id: str, horizon_seconds: int,
                    metrics: Metrics | None = None, events_window: float = EVENTS_WINDOW_SECONDS) -> int | None:
    """Replay (or cancel) the job's next chunk in one transaction; how many messages it handled (0: the
    job is finished now), or ``None`` when the job is no longer this daemon's to run. Messages a
    cancel job ends count as deaths where expiries do (the endpoint rollup, operator events,
    ``metrics``)."""
    cancelled: list[Any] = []
    settled = None
    async with engine.begin() as conn:
        locked = select(jobs).where(jobs.c.id == job_id)
        if conn.dialect.name == "postgresql":
            locked = locked.with_for_update()
        job = (await conn.execute(locked)).first()
        now = await store.db_now(conn)
        if job is None or job.state != "running" or (job.leased_by not in (None, daemon_id)
                                                      and (job.lease_until or 0) > now):
            return None
        selection = Selection(job.tenant_id, job.since, job.origin, job.reason, job.kind)
        size = max(1, min(CHUNK, int(job.rate)))
        ids = list((await conn.execute(select(messages.c.id).where(selection.where(job.until, job.cursor))
                                       .order_by(messages.c.id).limit(size))).scalars())
        if not ids:
            await conn.execute(update(jobs).where(jobs.c.id == job_id).values(
                state="done", leased_by=None, lease_until=None, updated_at=now))
            return 0
        if job.kind == "cancel":
            cancelled = await _cancel(conn, job_id, ids)
            replayed = [row.id for row in cancelled]
            if cancelled:
                settled = await record_deaths(conn, cancelled, "cancelled", daemon_id=daemon_id, window=events_window)
        else:
            replayed = await store.replay(conn, ids, force=job.force, horizon_seconds=horizon_seconds)
        if replayed:  # a second handling of a message by this job would violate the key: the chunk rolls back
            await conn.execute(insert(job_items), [{"job_id": job_id, "message_id": i} for i in replayed])
            await store.notify(conn)
        await conn.execute(update(jobs).where(jobs.c.id == job_id).values(
            cursor=max(ids), done=jobs.c.done + len(replayed), skipped=jobs.c.skipped + len(ids) - len(replayed),
            # held through the pause the rate puts before the next chunk, however long: a slow job
            # (0.05 a second is a chunk every 20 s) must not pass to another daemon meanwhile
            leased_by=daemon_id, lease_until=now + LEASE_SECONDS + len(ids) / job.rate, updated_at=now))
    if metrics is not None:
        count_deaths(metrics, settled, cancelled, "cancelled")
    return len(ids)


class JobRunner:
    """The daemon's side: take a running job no live daemon holds, run it chunk by chunk."""

    def __init__(self, engine: AsyncEngine, *, daemon_id: str, horizon_seconds: int, outage: OutageGuard,
                 metrics: Metrics | None = None, events_window: float = EVENTS_WINDOW_SECONDS,
                 halt: Halt | None = None) -> None:
        self._engine = engine
        self._halt = halt or Halt()  # the daemon's stop (supervisor/cycle/halting.py)
        self._daemon_id = daemon_id
        self._outage = outage
        self._chunk: dict[str, Any] = {"daemon_id": daemon_id, "horizon_seconds": horizon_seconds, "metrics": metrics,
                       "events_window": events_window}  # what every run_chunk is told
        self._log = structlog.get_logger("outboxd.jobs")

    async def _take(self) -> tuple[int, float] | None:
        """Lease the oldest running job that is free (or already ours): its id and rate."""
        free = "state = 'running' AND (leased_by IS NULL OR leased_by = :me OR lease_until < {now})"
        async with self._engine.connect() as conn:  # a read first: no write transaction (SQLite: lock) when idle
            if (await conn.execute(select(jobs.c.id).where(jobs.c.state == "running").limit(1))).first() is None:
                return None
        async with self._engine.begin() as conn:
            now = PG_NOW if conn.dialect.name == "postgresql" else SQLITE_NOW
            # The conditions are repeated outside the subquery: a replica that waited on the
            # row's lock re-checks them against the winner's update and takes nothing.
            row = (await conn.execute(text(
                f"UPDATE outbox_jobs SET leased_by = :me, lease_until = {now} + :lease "
                f"WHERE {free.format(now=now)} AND id = (SELECT id FROM outbox_jobs WHERE {free.format(now=now)} "
                "ORDER BY id LIMIT 1) RETURNING id, rate"), {"me": self._daemon_id, "lease": LEASE_SECONDS})).first()
        return None if row is None else (int(row.id), float(row.rate))

    async def run(self) -> None:
        """Run jobs until halted, between chunks (the daemon's stop); a chunk cut short by a
        cancel commits or rolls back whole."""
        while not self._halt.is_set:
            try:
                taken = await self._take()
                handled = None if taken is None else await run_chunk(self._engine, taken[0], **self._chunk)
                self._outage.ok("run recovery jobs")
            except Exception as exc:
                await self._halt.failed(self._outage, "run recovery jobs", exc)
                continue
            if taken is None or handled is None:
                await self._halt.pause(IDLE_SECONDS)
            elif handled == 0:
                self._log.info("job.done", job_id=taken[0])
            else:
                await self._halt.pause(handled / taken[1])  # the job's rate: messages per second
