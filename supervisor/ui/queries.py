"""What the console reads beyond the CLI's queries: the health strip, endpoints, pages of
messages and the failed attempts of an endpoint.

Every row shown passes through the same masking as ``outboxd show`` (:mod:`supervisor.operator.ops`):
URLs lose their query string and userinfo, errors lose any URL secret.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Table, func, or_, select, tuple_
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox import store
from outbox.breaker_rows import shown_columns
from outbox.schema import attempts, breakers, endpoint_stats, messages
from supervisor.keys import keyring
from supervisor.operator import ops
from supervisor.observe.health_stats import FAILED
from supervisor.ui.timeseries import Scope, recent_totals

RATE_SECONDS = 300  # the health strip's rates: the last five whole minutes and the current one
BACKLOG = ("pending", "in_flight")


@dataclass(frozen=True)
class Health:
    """The strip at the top of every overview: is delivery keeping up, and is it safe?"""

    now: float
    backlog: int
    oldest_due_seconds: float | None  # None: nothing is due
    delivered_per_minute: float
    failure_ratio: float | None  # failures / answered attempts; None: no attempt in the period
    daemons: int  # distinct daemons that recorded an attempt in the period
    open_breakers: int
    keys: dict[str, int]  # keyring keys by state (active, next, retiring, ...)
    keyless_scopes: list[str]  # scopes with keys but none active: their messages wait


async def health(conn: AsyncConnection, scope: Scope) -> Health:
    """The health strip for everyone, or for a tenant or endpoint's messages."""
    oldest, now = await store.next_due_at(conn)
    if scope.tenant is not None or scope.origin is not None:
        oldest = (await conn.execute(_narrow(select(func.min(messages.c.next_attempt_at))
                                             .where(messages.c.state == "pending"), scope))).scalar()
    backlog = (await conn.execute(_narrow(select(func.count()).select_from(messages)
                                          .where(messages.c.state.in_(BACKLOG)), scope))).scalar_one()
    recent = await recent_totals(conn, RATE_SECONDS, scope, now)
    delivered, failed = recent.delivered, recent.failed
    open_breakers = (await conn.execute(_narrow(select(func.count()).select_from(breakers)
                                                .where(breakers.c.state != "closed"), scope, breakers))).scalar_one()
    snapshot = await conn.run_sync(keyring.read_snapshot)
    keys: dict[str, int] = {}
    for record in snapshot.records:
        state = record.state(snapshot.now)
        keys[state] = keys.get(state, 0) + 1
    keyless = sorted(keyring.scope_label(s) for s in snapshot.by_scope if _unsigned(snapshot, s))
    return Health(now=now, backlog=int(backlog),
                  oldest_due_seconds=None if oldest is None or oldest > now else now - float(oldest),
                  delivered_per_minute=recent.per_minute(delivered),
                  failure_ratio=failed / (delivered + failed) if delivered + failed else None, daemons=recent.daemons,
                  open_breakers=int(open_breakers), keys=keys, keyless_scopes=keyless)


def _unsigned(snapshot: keyring.Snapshot, scope: str) -> bool:
    """Whether ``scope``'s messages cannot be signed: it has no active key, and it is the
    default scope or a tenant that has had keys of its own (which never falls back to the
    default; a tenant with only a staged key still signs with the default scope's)."""
    if snapshot.active(scope, snapshot.now) is not None:
        return False
    return scope == keyring.DEFAULT_SCOPE or snapshot.own_since.get(scope, float("inf")) <= snapshot.now


def _narrow(query: Any, scope: Scope, table: Table = messages) -> Any:
    """``query`` on ``table`` (messages or breakers: both keyed by tenant and origin) within ``scope``."""
    if scope.tenant is not None:
        query = query.where(table.c.tenant_id == scope.tenant)
    if scope.origin is not None:
        query = query.where(table.c.origin == scope.origin)
    return query


async def endpoints(conn: AsyncConnection, scope: Scope, limit: int) -> tuple[list[dict[str, Any]], int]:
    """Endpoints (tenant and origin) with their backlog and breaker: open breakers first, then
    the largest backlogs, then the most recently active; and how many more there are.

    An endpoint is known by its breaker row, by waiting messages, or by attempts in the last
    hour (the rollup the charts read: one whose messages all died at once has neither of the
    others). Only the endpoints in trouble and ``limit`` recent ones are read, however many
    endpoints there are."""
    waiting = {(t, o): int(n) for t, o, n in await conn.execute(_narrow(
        select(messages.c.tenant_id, messages.c.origin, func.count()).where(messages.c.state.in_(BACKLOG))
        .group_by(messages.c.tenant_id, messages.c.origin), scope)) if o is not None}
    hour_ago = int(await store.db_now(conn) // 60) - 60  # the rollup counts minutes since the epoch
    active = [(t, o) for t, o in await conn.execute(_narrow(
        select(endpoint_stats.c.tenant_id, endpoint_stats.c.origin).where(endpoint_stats.c.minute >= hour_ago)
        .group_by(endpoint_stats.c.tenant_id, endpoint_stats.c.origin)
        .order_by(func.max(endpoint_stats.c.minute).desc()).limit(limit), scope, endpoint_stats))]
    keys = list(set(waiting) | set(active))
    shown = shown_columns(conn)
    chosen = [_narrow(select(*shown).where(breakers.c.state != "closed"), scope, breakers),
              _narrow(select(*shown), scope, breakers).order_by(breakers.c.updated_at.desc()).limit(limit)]
    chosen += [select(*shown).where(tuple_(breakers.c.tenant_id, breakers.c.origin).in_(keys[i:i + 500]))
               for i in range(0, len(keys), 500)]
    rows = {(r["tenant_id"], r["origin"]): dict(r) for query in chosen for r in (await conn.execute(query)).mappings()}
    found = [{"tenant_id": t, "origin": o, "backlog": waiting.get((t, o), 0),
              "breaker": ops._breaker(rows[(t, o)]) if (t, o) in rows else None}
             for t, o in set(keys) | set(rows)]
    found.sort(key=lambda e: ((e["breaker"] or {}).get("updated_at") or "", e["tenant_id"], e["origin"]), reverse=True)
    found.sort(key=lambda e: (e["breaker"] is None or e["breaker"]["state"] == "closed", -e["backlog"]))
    known = (await conn.execute(_narrow(select(func.count()).select_from(breakers), scope, breakers))).scalar_one()
    known += sum(1 for key in keys if key not in rows)  # the active ones: at most ``limit`` of them
    return found[:limit], max(int(known) - min(len(found), limit), 0)


async def state_counts(conn: AsyncConnection, scope: Scope) -> dict[str, int]:
    """Messages of a tenant or an endpoint by state."""
    counts = dict((await conn.execute(_narrow(select(messages.c.state, func.count()), scope)
                                      .group_by(messages.c.state))).all())
    return {s: int(counts.get(s, 0)) for s in ("pending", "in_flight", "delivered", "dead")}


async def breaker(conn: AsyncConnection, tenant: str, origin: str) -> dict[str, Any] | None:
    row = (await conn.execute(select(*shown_columns(conn)).where(breakers.c.tenant_id == tenant, breakers.c.origin == origin))
           ).mappings().first()
    return None if row is None else ops._breaker(row)


async def failed_attempts(conn: AsyncConnection, scope: Scope, since: float, limit: int) -> list[dict[str, Any]]:
    """An endpoint's latest failed attempts since ``since``: status and the recorded error, masked."""
    query = (select(attempts).where(attempts.c.occurred_at >= since, attempts.c.outcome.in_(FAILED),
                                    scope.condition())
             .order_by(attempts.c.occurred_at.desc(), attempts.c.id.desc()).limit(limit))
    return [ops._attempt(r) for r in await conn.execute(query)]


@dataclass(frozen=True)
class Page:
    """One page of a message search, newest first, and where the next one starts."""

    rows: list[dict[str, Any]]
    total: int
    older: int | None  # the ``before`` of the next page; None on the last page


async def message_page(conn: AsyncConnection, filters: ops.Filters, before: int | None, size: int) -> Page:
    """Messages matching ``filters`` with an id below ``before``, newest first (keyset paging:
    any page costs the same, however deep)."""
    query = filters.where(select(*ops.MESSAGE_COLUMNS))
    if before is not None:
        query = query.where(messages.c.id < before)
    rows = [ops._message(r) for r in await conn.execute(query.order_by(messages.c.id.desc()).limit(size + 1))]
    older = rows[size - 1]["id"] if len(rows) > size else None
    return Page(rows[:size], await ops.count_matching(conn, filters), older)


async def messages_by_id(conn: AsyncConnection, ids: list[int]) -> list[dict[str, Any]]:
    """The named messages, masked, in id order (what a replay's dry run lists)."""
    if not ids:
        return []
    query = select(*ops.MESSAGE_COLUMNS).where(or_(*(messages.c.id.in_(ids[i:i + 500])
                                                     for i in range(0, len(ids), 500))))
    return [ops._message(r) for r in await conn.execute(query.order_by(messages.c.id))]
