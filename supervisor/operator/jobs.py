"""Recovery as a job: replay a tenant's dead messages, or cancel its pending ones, in the
background, durably.

``outboxd recover start`` counts what its selection matches (the dry run) and writes a job
row; the daemons run it (supervisor/cycle/job_runner.py). Each chunk is one transaction
that replays (or cancels) the next messages by id, records them in ``outbox_job_items``
and advances the job's cursor and counts: a daemon killed at any point leaves the job
exactly at its last committed chunk, and the next daemon to take the job resumes there.
The items' primary key (job, message) makes "each message handled at most once per job"
the database's rule.

The selection is fixed when the job is made. A ``replay`` job takes dead messages of the
tenant (optionally one origin and one dead reason) that ended between ``since`` and the
job's creation; a message replayed by the job that dies again is not taken twice. A
``cancel`` job takes the tenant's pending messages (optionally one origin) enqueued
between ``since`` and ``until`` (at most the job's creation) and ends them dead
``cancelled``; one leased in flight when the job reaches it is skipped and counted, never
ended under a daemon's lease (the update requires ``state = 'pending'``, which a claim
changes in the same row). A job runs on one daemon at a time (a lease on its row), at most
``rate`` messages per second, so recovering a whole outage does not crowd out live
traffic. Pause, resume and cancel change the row; the runner checks it before every
chunk. See docs/observability.md, "Recovery jobs".
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, func, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox import store
from outbox.schema import jobs, messages
from outbox.schema import db_now as db_clock
from outbox.activity import rfc3339
from supervisor.operator import when


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
                    m.dead_reason.not_in(store.NEVER_REPLAYED), text(f"NOT {store.SUBSCRIBER_REVOKED}"),
                    *([m.origin == self.origin] if self.origin else []),
                    *([m.dead_reason == self.reason] if self.reason else []))


def _until(selection: Selection, now: float) -> float:
    """Where the selection ends: now, or a cancel job's earlier end of its range."""
    return now if selection.until is None else min(selection.until, now)


def in_database_time(selection: Selection, now: float) -> Selection:
    """``selection`` with a time given as a duration ago counted back from ``now`` (the database's)."""
    return dataclasses.replace(selection, since=when.at(selection.since, now) or 0.0,
                               until=when.at(selection.until, now))


async def count(conn: AsyncConnection, selection: Selection) -> int:
    """The dry run: how many messages the selection matches now."""
    now = await store.db_now(conn)
    selection = in_database_time(selection, now)
    until = _until(selection, now)
    return int((await conn.execute(select(func.count()).where(selection.where(until)))).scalar_one())


async def create(conn: AsyncConnection, selection: Selection, *, force: bool, rate: float) -> dict[str, Any]:
    """Write a running job for ``selection``; the daemons pick it up within a second."""
    now = await store.db_now(conn)
    selection = in_database_time(selection, now)
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
    unaccounted = max(data["total"] - data["done"] - data["skipped"], 0)
    data["remaining"] = unaccounted if data["state"] != "done" else 0
    # Counted at the start, gone from the selection before the job reached them (replayed or
    # cancelled by hand, purged): a finished job accounts for every message it counted.
    data["left"] = unaccounted if data["state"] == "done" else 0
    return data


async def show(conn: AsyncConnection, job_id: int) -> dict[str, Any] | None:
    row = (await conn.execute(select(jobs).where(jobs.c.id == job_id))).first()
    return None if row is None else _job(row)


LISTED = 50  # jobs ``recover list`` and the console show, newest first, unless asked for more


async def list_jobs(conn: AsyncConnection, limit: int = LISTED) -> tuple[list[dict[str, Any]], int]:
    """The newest ``limit`` jobs, and how many jobs there are in all (a listing says what it left out)."""
    listed = [_job(r) for r in await conn.execute(select(jobs).order_by(jobs.c.id.desc()).limit(limit))]
    if len(listed) < limit:
        return listed, len(listed)
    return listed, int((await conn.execute(select(func.count()).select_from(jobs))).scalar_one())


async def change(conn: AsyncConnection, job_id: int, action: str) -> bool:
    """Pause, resume or cancel; ``False`` when the job is not in a state the action applies to."""
    allowed, new = TRANSITIONS[action]
    result = await conn.execute(update(jobs).where(jobs.c.id == job_id, jobs.c.state.in_(allowed))
                                .values(state=new, updated_at=db_clock()))
    return result.rowcount == 1
