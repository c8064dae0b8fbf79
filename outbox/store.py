"""Every statement the daemon and the CLI run, each with a name, in one place.

Reading this module tells the whole state machine (procrastinate-style):

    pending --claim--> in_flight --complete--> delivered | dead | pending (retry later)
    in_flight --lease expired (rescue)--> pending        pending --past horizon--> dead
    delivered | dead --replay--> pending

Statements are plain SQL with a dialect-specific clock and row source, so PostgreSQL and
SQLite run the same logic. Every time is the database's (``{now}``). Batches travel as one
JSON parameter, so a completion batch is one UPDATE whatever its size.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Text, bindparam, text, tuple_
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox.schema import PG_NOW, SQLITE_NOW, attempts, breakers

CHANNEL = "outbox_wakeup"
_PG_TYPES = {"int": "bigint", "float": "float8", "text": "text", "bool": "boolean"}


def _is_pg(conn: AsyncConnection) -> bool:
    return conn.dialect.name == "postgresql"


def _json_rows(pg: bool, columns: Sequence[tuple[str, str]]) -> str:
    """A row source reading ``:rows`` (a JSON array of objects) on either database."""
    if pg:
        spec = ", ".join(f"{name} {_PG_TYPES[kind]}" for name, kind in columns)
        return f"jsonb_to_recordset(CAST(:rows AS jsonb)) AS v({spec})"
    picks = ", ".join(f"json_extract(value, '$.{name}') AS {name}" for name, _ in columns)
    return f"(SELECT {picks} FROM json_each(:rows)) AS v"


class _Statements:
    """The SQL of one dialect, rendered once."""

    def __init__(self, pg: bool) -> None:
        now = PG_NOW if pg else SQLITE_NOW
        lock = "FOR UPDATE OF m SKIP LOCKED" if pg else ""
        lock_plain = "FOR UPDATE SKIP LOCKED" if pg else ""
        self.now = text(f"SELECT {now}")
        # The endpoint's breaker comes back with each claimed row, so the claim is one
        # statement. (The target table is not aliased: SQLite resolves RETURNING only so.)
        breaker = ("(SELECT b.{col} FROM outbox_breakers AS b WHERE b.tenant_id = outbox_messages.tenant_id"
                   " AND b.origin = outbox_messages.origin)")
        self.claim = text(f"""
            WITH due AS (
                SELECT m.id AS due_id FROM outbox_messages AS m
                WHERE m.state = 'pending' AND m.next_attempt_at <= {now}
                  AND (m.origin IS NULL OR m.origin NOT IN :busy)
                  AND NOT EXISTS (
                      SELECT 1 FROM outbox_breakers AS b
                      WHERE b.tenant_id = m.tenant_id AND b.origin = m.origin
                        AND ((b.state = 'open' AND b.open_until > {now})
                             OR (b.state = 'half_open' AND b.probe_until > {now})))
                ORDER BY m.next_attempt_at, m.id
                LIMIT :limit {lock}
            )
            UPDATE outbox_messages
            SET state = 'in_flight', lease_token = :token, lease_expires_at = {now} + :lease,
                leased_by = :daemon, attempts = attempts + 1,
                first_attempt_at = COALESCE(first_attempt_at, {now}),
                retry_until = COALESCE(retry_until, {now} + COALESCE(horizon_seconds, :horizon))
            FROM due WHERE outbox_messages.id = due.due_id
            RETURNING id, tenant_id, url, origin, idempotency_key, body, body_sha256, auth_mode, auth_secret,
                      sequence_number, notification_type, attempts, retry_until, created_at, trigger,
                      {now} AS claimed_at, {breaker.format(col="state")} AS breaker_state,
                      {breaker.format(col="open_until")} AS breaker_open_until
        """).bindparams(bindparam("busy", expanding=True, type_=Text()))
        # RETURNING must name bare columns (SQLite), so the row source avoids the table's names.
        completion = _json_rows(pg, [
            ("mid", "int"), ("tok", "text"), ("new_state", "text"), ("new_reason", "text"),
            ("new_next", "float"), ("delta", "int"), ("new_status", "int"), ("new_error", "text"),
        ])
        self.complete = text(f"""
            UPDATE outbox_messages AS m
            SET state = v.new_state, dead_reason = v.new_reason,
                next_attempt_at = COALESCE(v.new_next, m.next_attempt_at),
                attempts = m.attempts + v.delta, last_status = v.new_status,
                last_error = v.new_error, lease_token = NULL, lease_expires_at = NULL, leased_by = NULL,
                finished_at = CASE WHEN v.new_state IN ('delivered', 'dead') THEN {now} END,
                trigger = CASE WHEN v.new_state IN ('delivered', 'dead') THEN 'scheduled' ELSE m.trigger END
            FROM {completion}
            WHERE m.id = v.mid AND m.lease_token = v.tok AND m.state = 'in_flight'
            RETURNING id
        """)
        # Successes restart only when the open period ends: half-open takes one probe at a
        # time, so the successes that close the breaker accumulate across probes.
        self.acquire_probe = text(f"""
            UPDATE outbox_breakers SET state = 'half_open',
                successes = CASE WHEN state = 'open' THEN 0 ELSE successes END,
                probe_until = {now} + :lease, updated_at = {now}
            WHERE tenant_id = :tenant_id AND origin = :origin
              AND ((state = 'open' AND open_until <= {now})
                   OR (state = 'half_open' AND (probe_until IS NULL OR probe_until <= {now})))
        """)
        self.rescue = text(f"""
            UPDATE outbox_messages
            SET state = 'pending', next_attempt_at = {now}, lease_token = NULL, lease_expires_at = NULL,
                leased_by = NULL
            WHERE id IN (SELECT id FROM outbox_messages WHERE state = 'in_flight' AND lease_expires_at < {now}
                         ORDER BY lease_expires_at LIMIT :limit {lock_plain})
            RETURNING id, tenant_id, url, attempts, idempotency_key, sequence_number, notification_type,
                      trigger, leased_by, length(body) AS payload_size
        """)
        self.expire = text(f"""
            UPDATE outbox_messages SET state = 'dead', dead_reason = 'expired', finished_at = {now},
                last_error = 'retry horizon passed'
            WHERE id IN (SELECT id FROM outbox_messages WHERE state = 'pending' AND retry_until <= {now}
                         LIMIT :limit {lock_plain})
            RETURNING id, tenant_id
        """)
        # A breaker that opens defers its endpoint's backlog; each deferral is a circuit-open
        # skip in the attempt log (same transaction), numbered as the attempt it postpones.
        deferrable = ("state = 'pending' AND tenant_id = :tenant_id AND origin = :origin"
                      " AND next_attempt_at < :until")
        bare_url = "split_part(url, '?', 1)" if pg else \
            "CASE WHEN instr(url, '?') > 0 THEN substr(url, 1, instr(url, '?') - 1) ELSE url END"
        self.log_deferral = text(f"""
            INSERT INTO outbox_attempts (message_id, tenant_id, url, attempt_number, outcome, error, will_retry,
                next_retry_at, payload_size, sequence_number, idempotency_key, notification_type, trigger,
                daemon_id, occurred_at)
            SELECT id, tenant_id, {bare_url}, attempts + 1, 'circuit_open', 'circuit open: deferred', :yes,
                :until, length(body), sequence_number, idempotency_key, notification_type, trigger, :daemon, {now}
            FROM outbox_messages WHERE {deferrable}
        """)
        self.defer_endpoint = text(f"UPDATE outbox_messages SET next_attempt_at = :until WHERE {deferrable}")
        self.next_due = text(f"SELECT min(next_attempt_at), {now} FROM outbox_messages WHERE state = 'pending'")
        self.purge = text(f"""
            DELETE FROM outbox_messages
            WHERE id IN (SELECT id FROM outbox_messages
                         WHERE finished_at IS NOT NULL AND finished_at < {now} - :older_than
                           AND COALESCE(retry_until, created_at + COALESCE(horizon_seconds, :horizon)) < {now}
                         LIMIT :limit)
            RETURNING id
        """)
        self.purge_attempts = text("DELETE FROM outbox_attempts WHERE message_id IN :ids").bindparams(
            bindparam("ids", expanding=True))
        self.replay = text(f"""
            UPDATE outbox_messages
            SET state = 'pending', dead_reason = NULL, next_attempt_at = {now}, finished_at = NULL,
                trigger = 'replay', first_attempt_at = CASE WHEN :force THEN NULL ELSE first_attempt_at END,
                retry_until = CASE WHEN :force THEN NULL ELSE retry_until END
            WHERE id IN :ids AND state IN ('dead', 'delivered')
              AND (:force OR retry_until IS NULL OR retry_until > {now})
            RETURNING id
        """).bindparams(bindparam("ids", expanding=True))


_STATEMENTS = {True: _Statements(True), False: _Statements(False)}


def sql(conn: AsyncConnection) -> _Statements:
    return _STATEMENTS[_is_pg(conn)]


@dataclass(frozen=True)
class Claimed:
    """A leased message: everything one attempt needs, and the fence to record it with."""

    id: int
    tenant_id: str
    url: str
    origin: str | None
    idempotency_key: str
    body: bytes
    body_sha256: bytes | None
    auth_mode: str
    auth_secret: bytes | None
    sequence_number: int | None
    notification_type: str | None
    attempt: int
    retry_until: float
    created_at: float
    trigger: str
    claimed_at: float
    lease_token: str
    breaker_state: str | None = None  # this endpoint's breaker at claim time (None: no row)
    breaker_open_until: float | None = None


@dataclass(frozen=True)
class Completion:
    """The recorded outcome of one leased message."""

    message_id: int
    lease_token: str
    state: str  # delivered | pending | dead
    dead_reason: str | None = None
    next_attempt_at: float | None = None
    attempts_delta: int = 0  # -1 when the attempt was never made (circuit open)
    last_status: int | None = None
    last_error: str | None = None


async def db_now(conn: AsyncConnection) -> float:
    return float((await conn.execute(sql(conn).now)).scalar_one())


async def claim(
    conn: AsyncConnection,
    *,
    limit: int,
    lease_seconds: float,
    horizon_seconds: int,
    daemon_id: str,
    busy_origins: Iterable[str] = (),
) -> list[Claimed]:
    """Lease up to ``limit`` due messages in one statement (``FOR UPDATE SKIP LOCKED``).

    Messages behind an open breaker, or whose endpoint is at its concurrency limit in this
    daemon, are left for later. The horizon clock starts at the first claim (docs/protocol.md "Retry horizon").
    """
    token = uuid.uuid4().hex
    result = await conn.execute(sql(conn).claim, {
        "limit": limit, "lease": lease_seconds, "horizon": horizon_seconds, "daemon": daemon_id,
        "token": token, "busy": list(busy_origins),
    })
    return [
        Claimed(
            id=r.id, tenant_id=r.tenant_id, url=r.url, origin=r.origin, idempotency_key=r.idempotency_key,
            body=bytes(r.body), body_sha256=None if r.body_sha256 is None else bytes(r.body_sha256),
            auth_mode=r.auth_mode, auth_secret=None if r.auth_secret is None else bytes(r.auth_secret),
            sequence_number=r.sequence_number, notification_type=r.notification_type, attempt=r.attempts,
            retry_until=float(r.retry_until), created_at=float(r.created_at), trigger=r.trigger,
            claimed_at=float(r.claimed_at), lease_token=token, breaker_state=r.breaker_state,
            breaker_open_until=None if r.breaker_open_until is None else float(r.breaker_open_until),
        )
        for r in result
    ]


async def complete(conn: AsyncConnection, completions: Sequence[Completion]) -> set[int]:
    """Record outcomes in one statement; return the ids whose lease was still ours.

    The lease token is the fence: a daemon whose lease expired (and whose message another
    daemon re-leased) changes nothing.
    """
    if not completions:
        return set()
    rows = json.dumps([
        {"mid": c.message_id, "tok": c.lease_token, "new_state": c.state, "new_reason": c.dead_reason,
         "new_next": c.next_attempt_at, "delta": c.attempts_delta, "new_status": c.last_status,
         "new_error": c.last_error}
        for c in completions
    ])
    result = await conn.execute(sql(conn).complete, {"rows": rows})
    return {row.id for row in result}


async def insert_attempts(conn: AsyncConnection, rows: Sequence[dict[str, Any]]) -> None:
    if rows:
        await conn.execute(attempts.insert(), list(rows))


async def lock_breakers(conn: AsyncConnection, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    """Breaker rows for ``keys`` (tenant, origin), locked in key order (no deadlocks)."""
    wanted = sorted(set(keys))
    if not wanted:
        return {}
    query = breakers.select().where(tuple_(breakers.c.tenant_id, breakers.c.origin).in_(wanted))
    if _is_pg(conn):
        query = query.order_by(breakers.c.tenant_id, breakers.c.origin).with_for_update()
    rows = (await conn.execute(query)).mappings().all()
    return {(r["tenant_id"], r["origin"]): dict(r) for r in rows}


async def save_breakers(conn: AsyncConnection, rows: Sequence[dict[str, Any]]) -> None:
    """Upsert breaker rows (one statement per batch, whatever the number of keys)."""
    if not rows:
        return
    if _is_pg(conn):
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    statement = insert(breakers)
    columns = ("state", "failures", "successes", "trips", "open_until", "probe_until", "updated_at")
    statement = statement.on_conflict_do_update(
        index_elements=["tenant_id", "origin"], set_={c: statement.excluded[c] for c in columns}
    )
    await conn.execute(statement, list(rows))


async def defer_endpoint(conn: AsyncConnection, tenant_id: str, origin: str, until: float, daemon_id: str) -> int:
    """Push an endpoint's pending messages to ``until`` (its breaker's open period end),
    logging a ``circuit_open`` attempt row for each; no attempt is made or counted."""
    params = {"tenant_id": tenant_id, "origin": origin, "until": until, "daemon": daemon_id, "yes": True}
    await conn.execute(sql(conn).log_deferral, params)
    return (await conn.execute(sql(conn).defer_endpoint, params)).rowcount


async def acquire_probe(conn: AsyncConnection, tenant_id: str, origin: str, lease_seconds: float) -> bool:
    """Take the single half-open probe of a breaker whose open period is over."""
    result = await conn.execute(sql(conn).acquire_probe,
                                {"tenant_id": tenant_id, "origin": origin, "lease": lease_seconds})
    return result.rowcount == 1


async def rescue_expired_leases(conn: AsyncConnection, *, limit: int = 500) -> list[Any]:
    """Hand back messages whose daemon died mid-attempt (their lease ran out)."""
    return list(await conn.execute(sql(conn).rescue, {"limit": limit}))


async def expire_past_horizon(conn: AsyncConnection, *, limit: int = 500) -> list[str]:
    """End pending messages past their retry horizon as dead ``expired``; their tenants, one per message."""
    return [r.tenant_id for r in await conn.execute(sql(conn).expire, {"limit": limit})]


async def next_due_at(conn: AsyncConnection) -> tuple[float | None, float]:
    """When the earliest pending message is due, and the database's time now (one query)."""
    due, now = (await conn.execute(sql(conn).next_due)).one()
    return (None if due is None else float(due)), float(now)


async def purge_batch(conn: AsyncConnection, *, older_than: float, horizon_seconds: int, limit: int) -> int:
    """Delete one batch of finished history past both the retention and its retry horizon."""
    ids = [r.id for r in await conn.execute(sql(conn).purge,
                                              {"older_than": older_than, "horizon": horizon_seconds, "limit": limit})]
    if ids:
        await conn.execute(sql(conn).purge_attempts, {"ids": ids})
    return len(ids)


async def replay(conn: AsyncConnection, ids: Sequence[int], *, force: bool) -> list[int]:
    """Make finished messages due again, same bytes and key, marked as a replay."""
    if not ids:
        return []
    return [r.id for r in await conn.execute(sql(conn).replay, {"ids": list(ids), "force": force})]


async def notify(conn: AsyncConnection) -> None:
    """Wake idle daemons now (PostgreSQL; on SQLite daemons poll)."""
    if _is_pg(conn):
        await conn.execute(text("SELECT pg_notify(:channel, '')"), {"channel": CHANNEL})
