"""Recovery as a job: replay a tenant's dead messages, or cancel its pending ones, in the
background, durably.

``outboxd recover start`` counts what its selection matches (the dry run) and writes a job
row; the daemons run it (:class:`JobRunner`). Each chunk is one transaction that replays
(or cancels) the next messages by id, records them in ``outbox_job_items`` and advances
the job's cursor and counts: a daemon killed at any point leaves the job exactly at its
last committed chunk, and the next daemon to take the job resumes there. The items'
primary key (job, message) makes "each message handled at most once per job" the
database's rule.

The selection is fixed when the job is made. A ``replay`` job takes dead messages of the
tenant (optionally one origin and one dead reason) that ended between ``since`` and the
job's creation; a message replayed by the job that dies again is not taken twice. A
``cancel`` job takes the tenant's pending messages (optionally one origin) enqueued
between ``since`` and ``until`` (at most the job's creation) and ends them dead
``cancelled``; one leased in flight when the job reaches it is skipped and counted, never
ended under a daemon's lease (the update requires ``state = 'pending'``, which a claim
changes in the same row). A job runs on one daemon
at a time (a lease on its row), at most ``rate`` messages per second, so recovering a
whole outage does not crowd out live traffic. Pause, resume and cancel change the row;
the runner checks it before every chunk. See docs/observability.md, "Recovery jobs".
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from sqlalchemy import and_, func, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from outbox import store
from outbox.config import Settings
from outbox.schema import PG_NOW, SQLITE_NOW, job_items, jobs, messages
from outbox.schema import db_now as db_clock
from outbox.activity import rfc3339
from supervisor.cycle.maintenance import count_deaths, record_deaths

if TYPE_CHECKING:  # the daemon's cycle runs jobs; the guard and metrics are its, named here for annotations only
    from supervisor.cycle.outage import OutageGuard
    from supervisor.observe.metrics import Metrics

EVENTS_WINDOW_SECONDS = Settings().operator_events_window_seconds  # a runner told nothing else

CHUNK = 200  # messages per transaction at most (fewer when the rate is lower)
DEFAULT_RATE = 50  # messages per second: well below what live traffic to one endpoint takes
MAX_RATE = 100_000


def parse_rate(value: str) -> float:
    """A job's rate limit as typed (``outboxd recover start --rate``, the console's form):
    messages a second, above 0 and at most :data:`MAX_RATE`; fractions too (0.5 is one
    message every two seconds). Raises ``ValueError`` with a sentence the user can act on."""
    try:
        rate = float(str(value).strip())
    except ValueError:
        raise ValueError(f"{str(value)[:40]!r} is not a number") from None
    if not 0 < rate <= MAX_RATE:  # NaN fails this too
        raise ValueError(f"must be above 0 and at most {MAX_RATE:,} messages a second")
    return rate
LEASE_SECONDS = 10.0  # a job stays with its daemon while it renews this; a dead daemon's job moves on after it
IDLE_SECONDS = 1.0
# State changes an operator may ask for, and the states they apply to.
TRANSITIONS = {"pause": (("running",), "paused"), "resume": (("paused",), "running"),
               "cancel": (("running", "paused"), "cancelled")}


KINDS = ("replay", "cancel")


@dataclass(frozen=True)
class Selection:
    """Which messages a job takes: dead ones to replay, or (``kind='cancel'``) pending ones
    enqueued from ``since`` to ``until`` to end dead ``cancelled``."""

    tenant_id: str
    since: float
    origin: str | None = None
    reason: str | None = None
    kind: str = "replay"
    until: float | None = None  # cancel only: the end of the enqueue-time range (default: the job's creation)

    def where(self, until: float, after: int = 0) -> Any:
        m = messages.c
        if self.kind == "cancel":  # in flight too: reached while leased, it is skipped and counted
            return and_(m.state.in_(("pending", "in_flight")), m.tenant_id == self.tenant_id,
                        m.created_at >= self.since, m.created_at <= until, m.id > after,
                        *([m.origin == self.origin] if self.origin else []))
        return and_(m.state == "dead", m.tenant_id == self.tenant_id, m.finished_at >= self.since,
                    m.finished_at <= until, m.id > after,
                    # never what `outboxd replay` refuses (docs/subscribers.md): a URL that failed its
                    # proof, a cancelled message, a fire to a subscriber since removed, paused or moved
                    m.dead_reason.not_in(("proof_failed", "cancelled")), text(f"NOT {store.SUBSCRIBER_REVOKED}"),
                    *([m.origin == self.origin] if self.origin else []),
                    *([m.dead_reason == self.reason] if self.reason else []))


def _until(selection: Selection, now: float) -> float:
    """Where the selection ends: now, or a cancel job's earlier end of its range."""
    return now if selection.until is None else min(selection.until, now)


async def count(conn: AsyncConnection, selection: Selection) -> int:
    """The dry run: how many messages the selection matches now."""
    until = _until(selection, await store.db_now(conn))
    return int((await conn.execute(select(func.count()).where(selection.where(until)))).scalar_one())


async def create(conn: AsyncConnection, selection: Selection, *, force: bool, rate: float) -> dict[str, Any]:
    """Write a running job for ``selection``; the daemons pick it up within a second."""
    now = await store.db_now(conn)
    until = _until(selection, now)
    total = int((await conn.execute(select(func.count()).where(selection.where(until)))).scalar_one())
    job_id = (await conn.execute(insert(jobs).values(
        kind=selection.kind, state="running", tenant_id=selection.tenant_id, origin=selection.origin,
        reason=selection.reason, since=selection.since, until=until, force=force, rate=rate, total=total,
        created_at=now, updated_at=now).returning(jobs.c.id))).scalar_one()
    await store.notify(conn)
    return await show(conn, job_id) or {}


def _job(row: Any) -> dict[str, Any]:
    data = dict(row._mapping)
    for name in ("since", "until", "lease_until", "created_at", "updated_at"):
        data[name] = rfc3339(data[name])
    data["remaining"] = max(data["total"] - data["done"] - data["skipped"], 0) if data["state"] != "done" else 0
    return data


async def show(conn: AsyncConnection, job_id: int) -> dict[str, Any] | None:
    row = (await conn.execute(select(jobs).where(jobs.c.id == job_id))).first()
    return None if row is None else _job(row)


async def list_jobs(conn: AsyncConnection, limit: int = 50) -> list[dict[str, Any]]:
    return [_job(r) for r in await conn.execute(select(jobs).order_by(jobs.c.id.desc()).limit(limit))]


async def change(conn: AsyncConnection, job_id: int, action: str) -> bool:
    """Pause, resume or cancel; ``False`` when the job is not in a state the action applies to."""
    allowed, new = TRANSITIONS[action]
    result = await conn.execute(update(jobs).where(jobs.c.id == job_id, jobs.c.state.in_(allowed))
                                .values(state=new, updated_at=db_clock()))
    return result.rowcount == 1


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
                 metrics: Metrics | None = None, events_window: float = EVENTS_WINDOW_SECONDS) -> None:
        self._engine = engine
        self._daemon_id = daemon_id
        self._horizon = horizon_seconds
        self._outage = outage
        self._metrics = metrics
        self._events_window = events_window
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
        """Run jobs forever (cancelled at shutdown: the chunk under way commits or rolls back whole)."""
        while True:
            try:
                taken = await self._take()
                handled = None if taken is None else await run_chunk(
                    self._engine, taken[0], daemon_id=self._daemon_id, horizon_seconds=self._horizon,
                    metrics=self._metrics, events_window=self._events_window)
                self._outage.ok("run recovery jobs")
            except Exception as exc:
                await self._outage.failed("run recovery jobs", exc)
                continue
            if taken is None or handled is None:
                await asyncio.sleep(IDLE_SECONDS)
            elif handled == 0:
                self._log.info("job.done", job_id=taken[0])
            else:
                await asyncio.sleep(handled / taken[1])  # the job's rate: messages per second
