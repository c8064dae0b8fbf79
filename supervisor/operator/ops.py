"""What the operator CLI asks of the database: status, list, show, replay, breakers, purge.

Kept apart from the argument parsing so each query is testable and the CLI stays a thin
layer of flags and printing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Label, Select, String, and_, delete, func, literal_column, or_, select, true
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from outbox import store
from outbox.activity import rfc3339
from outbox.masking import REDACTED, is_secret_key
from outbox.producer import decode_body
from outbox.breaker_rows import shown_columns
from outbox.schema import attempts, breakers, messages, subscribers
from outbox.urls import public_url, redact_urls
from outbox.sealing import SealError, SealingKeys, plaintext
from supervisor.operator import when

MESSAGE_COLUMNS = [c for c in messages.c if c.name not in ("body", "body_sha256", "body_key_id", "auth_secret",
                                                         "lease_token")]


def _with_times(data: dict[str, Any]) -> dict[str, Any]:
    """Every stored time (``*_at``, ``*_until``) of a row as RFC 3339, the rest unchanged."""
    return {k: rfc3339(v) if k.endswith(("_at", "_until")) and isinstance(v, (int, float)) else v
            for k, v in data.items()}


class _PublicUrl(FunctionElement[str]):
    """A stored URL as :func:`outbox.urls.public_url` shows it (no userinfo, query or
    fragment), in SQL: what a URL filter may match. Matching the stored URL itself would let
    anyone who can filter (the console's token) find a buyer's query-string secret one
    character at a time, while every listing masks it."""

    type = String()
    inherit_cache = True


@compiles(_PublicUrl, "postgresql")
def _public_url_pg(element: _PublicUrl, compiler: Any, **kw: Any) -> str:
    url = compiler.process(element.clauses, **kw)
    return f"regexp_replace({url}, '^([^:/?#]+://)([^/?#]*@)?([^?#]*).*$', '\\1\\3')"


@compiles(_PublicUrl, "sqlite")
def _public_url_sqlite(element: _PublicUrl, compiler: Any, **kw: Any) -> str:
    # Only the producer writes SQLite rows (no SQL contract there): canonical URLs, whose one
    # secret-bearing part is the query.
    url = compiler.process(element.clauses, **kw)
    return f"substr({url}, 1, instr({url} || '?', '?') - 1)"


@dataclass(frozen=True)
class Filters:
    """The selection shared by ``list`` and ``replay``."""

    state: str | None = None
    reason: str | None = None
    tenant: str | None = None
    key: str | None = None  # idempotency key
    url: str | None = None  # substring of the URL as shown (no query: it may hold the buyer's secrets)
    origin: str | None = None  # the endpoint's origin, exactly (``outbox.urls.origin``)
    since: float | None = None  # created_at >= since (epoch seconds)
    until: float | None = None
    limit: int = 100

    def apply(self, query: Select[Any]) -> Select[Any]:
        """``query`` narrowed to the matching messages, oldest first, at most ``limit``."""
        return self.where(query).order_by(messages.c.id).limit(self.limit)

    def where(self, query: Select[Any]) -> Select[Any]:
        conditions = []
        if self.state:
            conditions.append(messages.c.state == self.state)
        if self.reason:
            conditions.append(messages.c.dead_reason == self.reason)
        if self.tenant:
            conditions.append(messages.c.tenant_id == self.tenant)
        if self.key:
            conditions.append(messages.c.idempotency_key == self.key)
        if self.url:
            conditions.append(_PublicUrl(messages.c.url).contains(self.url, autoescape=True))
        if self.origin:
            conditions.append(messages.c.origin == self.origin)
        if self.since is not None:
            conditions.append(messages.c.created_at >= when.in_sql(self.since))
        if self.until is not None:
            conditions.append(messages.c.created_at < when.in_sql(self.until))
        return query.where(and_(true(), *conditions))


def _message(row: Any) -> dict[str, Any]:
    """A message for display: buyers put secrets in query strings and userinfo, so every
    field that may hold a URL (a stream key embeds one, a plain-SQL row may carry anything)
    shows only :func:`outbox.urls.public_url` forms."""
    data = {c.name: row._mapping[c.name] for c in MESSAGE_COLUMNS}
    data["url"] = public_url(data["url"])
    for field in ("origin", "sequence_key", "last_error"):
        if data[field] is not None:
            data[field] = redact_urls(data[field])
    return _with_times(data)


def _attempt(row: Any) -> dict[str, Any]:
    data = dict(row._mapping)
    data["url"] = public_url(data["url"])
    if data["error"] is not None:
        data["error"] = redact_urls(data["error"])
    return _with_times(data)


async def status(conn: AsyncConnection, *, top: int = 5) -> dict[str, Any]:
    counts: dict[str, int] = dict((await conn.execute(select(messages.c.state, func.count()).group_by(messages.c.state))).all())
    dead: dict[str | None, int] = dict((await conn.execute(select(messages.c.dead_reason, func.count())
                                    .where(messages.c.state == "dead").group_by(messages.c.dead_reason))).all())
    oldest, now = await store.next_due_at(conn)
    open_rows = (await conn.execute(select(*shown_columns(conn)).where(breakers.c.state != "closed")
                                    .order_by(breakers.c.tenant_id, breakers.c.origin))).mappings().all()
    backlog = (await conn.execute(
        select(messages.c.tenant_id, func.count().label("n"))
        .where(messages.c.state.in_(("pending", "in_flight")))
        .group_by(messages.c.tenant_id).order_by(func.count().desc(), messages.c.tenant_id).limit(top)
    )).all()
    return {
        "messages": {s: int(counts.get(s, 0)) for s in ("pending", "in_flight", "delivered", "dead")},
        "oldest_due_age_seconds": round(max(now - oldest, 0.0), 3) if oldest is not None and oldest <= now else 0.0,
        "next_due_in_seconds": round(oldest - now, 3) if oldest is not None and oldest > now else None,
        "dead_by_reason": {str(k): int(v) for k, v in sorted(dead.items(), key=lambda kv: str(kv[0]))},
        "open_breakers": [_breaker(r) for r in open_rows],
        "top_tenants_by_backlog": [{"tenant_id": t, "backlog": int(n)} for t, n in backlog],
    }


async def list_messages(conn: AsyncConnection, filters: Filters) -> list[dict[str, Any]]:
    rows = await conn.execute(filters.apply(select(*MESSAGE_COLUMNS)))
    return [_message(r) for r in rows]


async def count_matching(conn: AsyncConnection, filters: Filters) -> int:
    """How many messages match ``filters``, ignoring its limit (for "N more matched")."""
    return int((await conn.execute(filters.where(select(func.count()).select_from(messages)))).scalar_one())


class AmbiguousReference(ValueError):
    """An idempotency key that several tenants use (keys are per tenant): name the id."""


async def one_tenant_uses(conn: AsyncConnection, key: str) -> None:
    """Raise :class:`AmbiguousReference` when several tenants hold idempotency key ``key``: a
    replay by key alone would send every tenant's message, each buyer one it never asked for."""
    tenants = (await conn.execute(select(func.count(func.distinct(messages.c.tenant_id)))
                                  .where(messages.c.idempotency_key == key))).scalar_one()
    if tenants > 1:
        raise AmbiguousReference(f"{tenants} tenants use the idempotency key {key!r} (keys are per tenant): "
                                 "name the tenant too, or the message ids")


def row_id(value: str) -> int | None:
    """A job's or a message's id as typed; ``None`` for anything that cannot be one ("¹", "0",
    past BIGINT: ids count from 1). An all-digit idempotency key (a snowflake id) may be
    longer: it is looked up as a key only."""
    number = int(value) if value.isascii() and value.isdigit() and 0 < len(value) < 19 else 0
    return number if number > 0 else None


async def find(conn: AsyncConnection, ref: str) -> Any | None:
    """A message by numeric id or by idempotency key (refused when several tenants hold it)."""
    condition = messages.c.idempotency_key == ref
    if (number := row_id(ref)) is not None:
        condition = or_(messages.c.id == number, condition)
    rows = (await conn.execute(select(messages).where(condition).order_by(messages.c.id).limit(2))).all()
    if len(rows) > 1:
        raise AmbiguousReference(f"{ref!r} names several messages (keys are per tenant): use the message id")
    return rows[0] if rows else None


async def show(conn: AsyncConnection, ref: str, keys: SealingKeys | None = None) -> dict[str, Any] | None:
    """One message for an operator: its payload opened (when sealed) and masked, and every attempt."""
    row = await find(conn, ref)
    if row is None:
        return None
    data = _message(row)
    try:
        body = plaintext(row, keys)
    except SealError as exc:
        data["payload_size"], data["payload"] = None, f"<sealed: {exc}>"
    else:
        data["payload_size"] = len(body)
        data["payload"] = redact(decode_body(body)) if decode_body(body) is not None else None
    history = await conn.execute(select(attempts).where(attempts.c.message_id == row.id)
                                 .order_by(attempts.c.attempt_number, attempts.c.id))
    data["attempt_trail"] = [_attempt(a) for a in history]
    if row.subscriber_ref is not None:  # an account-level fire or URL proof: its subscriber's state
        data["subscriber_state"] = (await conn.execute(select(subscribers.c.state).where(
            subscribers.c.id == row.subscriber_ref))).scalar() or "removed"
    return data


def redact(value: Any) -> Any:
    """A payload for display: credentials masked at any depth, URLs without query strings.

    Every view of a body (``outboxd show``, the console) goes through here, so no screen or
    terminal ever shows a buyer's token or a credential embedded in a URL.
    """
    if isinstance(value, dict):
        return {k: REDACTED if is_secret_key(k) and v is not None else redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str) and "://" in value:
        return redact_urls(value)
    return value


async def select_ids(conn: AsyncConnection, filters: Filters) -> list[int]:
    return list((await conn.execute(filters.apply(select(messages.c.id)))).scalars())


def horizon_end(row: Any, horizon_seconds: int) -> float:
    """When a message's retry horizon ends: enqueue + horizon, or a forced replay's own stamp."""
    if row.retry_until is not None:
        return float(row.retry_until)
    return float(row.created_at) + (row.horizon_seconds or horizon_seconds)


async def replay_candidates(conn: AsyncConnection, ids: Sequence[int], horizon_seconds: int) -> list[dict[str, Any]]:
    now = await store.db_now(conn)
    revoked: Label[Any] = literal_column(store.SUBSCRIBER_REVOKED).label("subscriber_revoked")
    rows = await conn.execute(select(*MESSAGE_COLUMNS, revoked).where(messages.c.id.in_(list(ids)))
                              .order_by(messages.c.id))
    result = []
    for row in rows:
        item = _message(row)
        item["past_horizon"] = horizon_end(row, horizon_seconds) <= now
        # A fire whose subscriber URL failed its proof, or whose subscriber was removed,
        # paused or moved, is never sent there (docs/subscribers.md, docs/reporting.md).
        item["subscriber_revoked"] = bool(row.subscriber_revoked)
        item["replayable"] = (row.state in ("dead", "delivered") and not row.subscriber_revoked
                              and row.dead_reason not in store.NEVER_REPLAYED)
        result.append(item)
    return result


async def list_breakers(conn: AsyncConnection) -> list[dict[str, Any]]:
    rows = await conn.execute(select(*shown_columns(conn)).order_by(breakers.c.tenant_id, breakers.c.origin))
    return [_breaker(r) for r in rows.mappings()]


def _breaker(row: Any) -> dict[str, Any]:
    """A breaker for display (a pre-0002 plain-SQL origin could keep userinfo)."""
    return _with_times({**row, "origin": redact_urls(row["origin"])})


async def reset_breaker(conn: AsyncConnection, tenant_id: str, origin: str) -> bool:
    result = await conn.execute(delete(breakers).where(breakers.c.tenant_id == tenant_id,
                                                       breakers.c.origin == origin))
    return result.rowcount > 0
