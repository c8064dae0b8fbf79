"""Every statement of the message state machine the daemon and the CLI run, each with a
name, in one place (the breaker rows' are in outbox/breaker_rows.py).

Reading this module tells the whole state machine (procrastinate-style):

    pending --claim--> in_flight --complete--> delivered | dead | pending (retry later)
    in_flight --lease expired (rescue)--> pending        pending --past horizon--> dead
    delivered | dead --replay--> pending

Statements are plain SQL with a dialect-specific clock and row source, so PostgreSQL and
SQLite run the same logic. Every time is the database's (``{now}``). Batches travel as one
JSON parameter, so a completion batch is one UPDATE whatever its size.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import TextClause, bindparam, text
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox.claim_sql import DEADLINE, GATHER_DUE, MIN_HORIZON_SECONDS, PILE, claim_sql
from outbox.leases import Claimed, ClaimedBatch, Completion, RescuedLease
from outbox.schema import PG_NOW, SQLITE_NOW, attempts
from outbox.sealing import OVERHEAD
from outbox.urls import endpoint_origin

CHANNEL = "outbox_wakeup"
_PG_TYPES = {"int": "bigint", "float": "float8", "text": "text", "bool": "boolean"}


def _is_pg(conn: AsyncConnection) -> bool:
    return conn.dialect.name == "postgresql"


def json_rows(pg: bool, columns: Sequence[tuple[str, str]]) -> str:
    """A row source reading ``:rows`` (a JSON array of objects) on either database."""
    if pg:
        spec = ", ".join(f"{name} {_PG_TYPES[kind]}" for name, kind in columns)
        return f"jsonb_to_recordset(CAST(:rows AS jsonb)) AS v({spec})"
    picks = ", ".join(f"json_extract(value, '$.{name}') AS {name}" for name, _ in columns)
    return f"(SELECT {picks} FROM json_each(:rows)) AS v"


# A fire to an account's subscriber is sent only while that subscriber is active at the
# fire's URL: once it is removed, paused or moved to another URL (docs/subscribers.md:
# "nothing more is sent"), no replay sends it there, whatever the fire's own state. SQL on
# the unaliased outbox_messages, for the replay and the operator's dry run alike.
NEVER_REPLAYED = ("proof_failed", "cancelled")  # dead reasons no replay undoes (a failed proof, a revocation)
SUBSCRIBER_REVOKED = """(outbox_messages.subscriber_ref IS NOT NULL
    AND COALESCE(outbox_messages.notification_type, '') <> 'webhook.challenge'
    AND NOT EXISTS (SELECT 1 FROM outbox_subscribers AS s WHERE s.id = outbox_messages.subscriber_ref
                    AND s.state = 'active' AND s.url = outbox_messages.url))"""


class _Statements:
    """The SQL of one dialect, rendered once."""

    def __init__(self, pg: bool) -> None:
        now = PG_NOW if pg else SQLITE_NOW
        lock_plain = "FOR UPDATE SKIP LOCKED" if pg else ""
        self.now = text(f"SELECT {now}")
        # The size of what is sent, not of what is stored (a sealed body carries a fixed overhead).
        plain_size = f"length(body) - CASE WHEN body_key_id IS NULL THEN 0 ELSE {OVERHEAD} END"
        self.claim = text(claim_sql(pg, now))
        self.gather_due = text(GATHER_DUE)
        # RETURNING must name bare columns (SQLite), so the row source avoids the table's names.
        completion = json_rows(pg, [
            ("mid", "int"), ("tok", "text"), ("new_state", "text"), ("new_reason", "text"),
            ("new_next", "float"), ("delta", "int"), ("new_status", "int"), ("new_error", "text"),
            ("new_origin", "text"),
        ])
        # PostgreSQL: the ids again, as an array, so the rows are found by primary key. Left
        # to the join alone, the planner could read them through the in-flight index instead,
        # whose dead entries (one per message delivered since the last vacuum) a bitmap scan
        # visits every time: 5 ms a completion with a backlog of 30,000 (docs/performance.md).
        by_key = " AND m.id = ANY(CAST(:ids AS bigint[]))" if pg else ""
        self.complete = text(f"""
            UPDATE outbox_messages AS m
            SET state = v.new_state, dead_reason = v.new_reason,
                next_attempt_at = COALESCE(v.new_next, m.next_attempt_at),
                attempts = m.attempts + v.delta, last_status = v.new_status,
                last_error = v.new_error, origin = COALESCE(v.new_origin, m.origin),
                lease_token = NULL, lease_expires_at = NULL, leased_by = NULL,
                finished_at = CASE WHEN v.new_state IN ('delivered', 'dead') THEN {now} END,
                trigger = CASE WHEN v.new_state IN ('delivered', 'dead') THEN 'scheduled' ELSE m.trigger END
            FROM {completion}
            WHERE m.id = v.mid AND m.lease_token = v.tok AND m.state = 'in_flight'{by_key}
            RETURNING id
        """)
        # Who held each lease and until when are read before the rows are handed back (an
        # UPDATE's RETURNING sees only the new, cleared values): the abandoned attempt names
        # the daemon that died and starts when its lease began.
        self.rescue_pick = text(f"""
            SELECT id, leased_by, lease_expires_at FROM outbox_messages
            WHERE state = 'in_flight' AND lease_expires_at < {now}
            ORDER BY lease_expires_at LIMIT :limit {lock_plain}
        """)
        self.rescue = text(f"""
            UPDATE outbox_messages
            SET state = 'pending', next_attempt_at = {now}, lease_token = NULL, lease_expires_at = NULL,
                leased_by = NULL
            WHERE id IN :ids AND state = 'in_flight' AND lease_expires_at < {now}
            RETURNING id, tenant_id, url, attempts, idempotency_key, sequence_number, notification_type,
                      trigger, {plain_size} AS payload_size
        """).bindparams(bindparam("ids", expanding=True))
        # Past created_at + horizon (a forced replay's own retry_until aside) ends dead,
        # attempted or not. Every deadline is at least MIN_HORIZON after enqueue, so the
        # pending-by-enqueue-time index bounds the sweep to rows that can be due to expire.
        self.expire = text(f"""
            UPDATE outbox_messages SET state = 'dead', dead_reason = 'expired', finished_at = {now},
                last_error = 'retry horizon passed'
            WHERE id IN (SELECT id FROM outbox_messages
                         WHERE state = 'pending' AND created_at <= {now} - :min_horizon
                           AND {DEADLINE} <= {now}
                         LIMIT :limit {lock_plain})
              AND state = 'pending'
            RETURNING id, tenant_id, origin
        """)
        pending = "FROM outbox_messages WHERE state = 'pending'"
        self.next_due = text(f"SELECT min(next_attempt_at), {now} {pending}")
        # The idle claimer's look ahead: the same, and whether a pile of arrivals is left to
        # fold (more than arrive while a claim runs, which the next NOTIFY brings anyway).
        unfolded = f"EXISTS (SELECT 1 FROM outbox_due_arrivals OFFSET {PILE})" if pg else "0"
        self.idle_outlook = text(f"SELECT min(next_attempt_at), {now}, {unfolded} {pending}")
        # The daemons' own lag: the oldest due message no breaker holds back (an open or
        # half-open breaker's backlog is that buyer's outage, not the daemons falling behind).
        self.delivery_lag = text(f"""
            SELECT min(m.next_attempt_at), {now} FROM outbox_messages AS m
            WHERE m.state = 'pending' AND m.next_attempt_at <= {now}
              AND NOT EXISTS (SELECT 1 FROM outbox_breakers AS b WHERE b.tenant_id = m.tenant_id
                              AND b.origin = COALESCE(m.origin, '') AND b.state <> 'closed')
        """)
        # Gauges read only the partial indexes of live rows: their cost is what is due,
        # never the history (delivered and dead are counters, outbox_deliveries_total).
        self.live_counts = text("SELECT (SELECT count(*) FROM outbox_messages WHERE state = 'pending'),"
                                " (SELECT count(*) FROM outbox_messages WHERE state = 'in_flight')")
        # The state is checked again on the row being deleted (not only in the subquery): a
        # row a concurrent ``replay --force`` made pending after the subquery saw it is kept
        # (PostgreSQL re-evaluates the outer condition on the row's latest version).
        finished = (f"state IN ('delivered', 'dead') AND finished_at IS NOT NULL AND finished_at < {now} - :older_than"
                    f" AND {DEADLINE} < {now}")
        self.purge = text(f"""
            DELETE FROM outbox_messages
            WHERE id IN (SELECT id FROM outbox_messages WHERE {finished} LIMIT :limit) AND {finished}
            RETURNING id
        """)
        self.purge_count = text(f"SELECT count(*) FROM outbox_messages WHERE {finished}")
        self.purge_attempts = text("DELETE FROM outbox_attempts WHERE message_id IN :ids").bindparams(
            bindparam("ids", expanding=True))
        self.replay = text(f"""
            UPDATE outbox_messages
            SET state = 'pending', dead_reason = NULL, next_attempt_at = {now}, finished_at = NULL,
                trigger = 'replay', first_attempt_at = CASE WHEN :force THEN NULL ELSE first_attempt_at END,
                retry_until = CASE WHEN :force THEN {now} + COALESCE(horizon_seconds, :horizon) ELSE retry_until END
            WHERE id IN :ids AND state IN ('dead', 'delivered')
              AND (:force OR {DEADLINE} > {now})
              -- never to a URL that failed its proof, nor to a revoked subscriber
              AND COALESCE(dead_reason, '') NOT IN {NEVER_REPLAYED!r} AND NOT ({SUBSCRIBER_REVOKED})
            RETURNING id
        """).bindparams(bindparam("ids", expanding=True))


_STATEMENTS = {True: _Statements(True), False: _Statements(False)}


def sql(conn: AsyncConnection) -> _Statements:
    return _STATEMENTS[_is_pg(conn)]


async def db_now(conn: AsyncConnection) -> float:
    return float((await conn.execute(sql(conn).now)).scalar_one())


def _in_claim_order(rows: Iterable[Any]) -> list[Any]:
    """Leased rows in the order the claim picked them: each endpoint's oldest due first, and
    an origin's endpoints taking turns (first of each, then second of each).

    An UPDATE's RETURNING comes in whatever order its plan meets the rows (a hash join meets
    them in storage order, which updates and reused space shuffle), so the order is restored
    here; the dispatcher starts each origin's messages in the order it is handed them.
    """
    by_due = sorted(rows, key=lambda r: (r.next_attempt_at, r.id))
    taken: Counter[tuple[str, str | None]] = Counter()
    turn: dict[int, int] = {}
    for row in by_due:
        taken[(row.tenant_id, row.origin)] += 1
        turn[row.id] = taken[(row.tenant_id, row.origin)]
    return sorted(by_due, key=lambda r: turn[r.id])  # stable: due order within a turn


async def _fold_and_claim(conn: AsyncConnection, params: Mapping[str, Any]) -> Any:
    """PostgreSQL folds the due arrivals in (``gather_due``), then claims; SQLite claims.
    On the daemon's own psycopg connection (supervisor/cycle/pgdirect.py) the two go in one
    pipeline: one round trip and one commit."""
    statements = sql(conn)
    pipelined = getattr(conn, "execute_after", None)
    if pipelined is not None:
        return await pipelined(statements.gather_due, statements.claim, params)
    if _is_pg(conn):
        await conn.execute(statements.gather_due)
    return await conn.execute(statements.claim, params)


async def claim(
    conn: AsyncConnection,
    *,
    limit: int,
    lease_seconds: float,
    horizon_seconds: int,
    daemon_id: str,
    endpoint_concurrency: int,
    held: Mapping[str, int] | None = None,
    sent: float | None = None,
) -> ClaimedBatch:
    """Lease up to ``limit`` messages that may be sent now, in one statement.

    Endpoints behind an open breaker are passed over, an origin gets no more than
    ``endpoint_concurrency`` leases from this daemon (``held``: the leases it holds per
    origin, keyed like ``Claimed.origin`` with ``""`` for none, counted in memory by the
    daemon: requests open, failures not yet judged, messages waiting), and claiming starts no clock: the
    retry horizon counts from enqueue (``retry_until`` is stamped with that deadline).
    Each row's origin is recomputed from its URL with :func:`outbox.urls.endpoint_origin`
    (the completion writes back a stored one that differs): a row a plain-SQL producer wrote
    on SQLite, or with an origin of its own, is keyed like every other.

    ``sent`` is when (``time.monotonic()``) the caller began the claim, before opening its
    transaction; each message carries it as ``claim_sent`` (now, if not given).

    Two daemons' claims read the same heads (each endpoint's oldest due rows): the later one
    skips what the earlier holds or has leased, and comes back short. The batch says so
    (``contended``), so its caller claims again rather than wait for new work.
    """
    sent = time.monotonic() if sent is None else sent
    token = uuid.uuid4().hex
    params = {"limit": limit, "lease": lease_seconds, "horizon": horizon_seconds, "daemon": daemon_id,
              "token": token, "cap": endpoint_concurrency, "held": json.dumps(dict(held or {}))}
    rows = list(await _fold_and_claim(conn, params))
    batch = ClaimedBatch(
        Claimed(
            id=r.id, tenant_id=r.tenant_id, url=r.url, origin=endpoint_origin(r.url), stored_origin=r.origin,
            idempotency_key=r.idempotency_key,
            body=bytes(r.body), body_sha256=None if r.body_sha256 is None else bytes(r.body_sha256),
            body_key_id=r.body_key_id, auth_mode=r.auth_mode,
            auth_secret=None if r.auth_secret is None else bytes(r.auth_secret),
            sequence_number=r.sequence_number, notification_type=r.notification_type, attempt=r.attempts,
            retry_until=float(r.retry_until), created_at=float(r.created_at), trigger=r.trigger,
            claimed_at=float(r.claimed_at), lease_token=token, breaker_state=r.breaker_state,
            breaker_open_until=None if r.breaker_open_until is None else float(r.breaker_open_until),
            claim_sent=sent,
            traceparent=r.traceparent, subscriber_ref=r.subscriber_ref,
        )
        # Without an id: PostgreSQL's row of the count alone, nothing leased.
        for r in _in_claim_order(r for r in rows if r.id is not None)
    )
    if _is_pg(conn) and rows:
        batch.contended = len(batch) < rows[0].wanted
        batch.retired = rows[0].retired
    return batch


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
         "new_error": c.last_error, "new_origin": c.origin}
        for c in completions
    ])
    params: dict[str, Any] = {"rows": rows}
    if _is_pg(conn):
        params["ids"] = [c.message_id for c in completions]
    result = await conn.execute(sql(conn).complete, params)
    return {row.id for row in result}


_INSERT_ATTEMPTS = attempts.insert()  # one statement object: supervisor/cycle/pgdirect.py caches its rendering
_KINDS = {bool: "bool", int: "int", float: "float"}  # of a column's Python type; anything else is text


@functools.lru_cache(maxsize=8)
def _pg_attempt_insert(columns: tuple[str, ...]) -> TextClause:
    """One INSERT of a batch's attempt rows from a JSON array, per set of columns (one
    object per set, so its rendering is cached like every statement's)."""
    names = ", ".join(columns)
    source = json_rows(True, [(name, _KINDS.get(attempts.c[name].type.python_type, "text")) for name in columns])
    return text(f"INSERT INTO outbox_attempts ({names}) SELECT {names} FROM {source}")


async def insert_attempts(conn: AsyncConnection, rows: Sequence[dict[str, Any]]) -> None:
    """Insert attempt rows (each with the same columns). On PostgreSQL one statement per batch
    reads them from a JSON array: a statement per row cost the daemon about 24 µs of CPU and
    the server 23 µs per row, the array 12–13 and 17–20 (docs/performance.md)."""
    if not rows:
        return
    if _is_pg(conn):
        await conn.execute(_pg_attempt_insert(tuple(rows[0])), {"rows": json.dumps(list(rows))})
    else:
        await conn.execute(_INSERT_ATTEMPTS, list(rows))


async def rescue_expired_leases(conn: AsyncConnection, *, limit: int = 500) -> list[RescuedLease]:
    """Hand back messages whose daemon died mid-attempt (their lease ran out), each with the
    lease it held."""
    statements = sql(conn)
    held = {r.id: r for r in await conn.execute(statements.rescue_pick, {"limit": limit})}
    if not held:
        return []
    rows = await conn.execute(statements.rescue, {"ids": sorted(held)})
    return [RescuedLease(**r._mapping, leased_by=held[r.id].leased_by,
                         lease_expires_at=held[r.id].lease_expires_at) for r in rows]


async def expire_past_horizon(conn: AsyncConnection, *, horizon_seconds: int, limit: int = 500) -> list[Any]:
    """End ``dead expired`` what is pending past its horizon (attempted or not); their (id, tenant_id, origin) rows."""
    params = {"limit": limit, "horizon": horizon_seconds, "min_horizon": MIN_HORIZON_SECONDS}
    return list(await conn.execute(sql(conn).expire, params))


async def live_counts(conn: AsyncConnection) -> tuple[int, int]:
    """(pending, in_flight): read from the partial indexes, whatever the history."""
    pending, in_flight = (await conn.execute(sql(conn).live_counts)).one()
    return int(pending), int(in_flight)


async def next_due_at(conn: AsyncConnection) -> tuple[float | None, float]:
    """When the earliest pending message is due, and the database's time now (one query)."""
    due, now = (await conn.execute(sql(conn).next_due)).one()
    return (None if due is None else float(due)), float(now)


async def oldest_unheld_due(conn: AsyncConnection) -> tuple[float | None, float]:
    """When the earliest due message that no open or half-open breaker holds back became
    due (``None``: none is due), and the database's time now (one query)."""
    due, now = (await conn.execute(sql(conn).delivery_lag)).one()
    return (None if due is None else float(due)), float(now)


async def idle_outlook(conn: AsyncConnection) -> tuple[float | None, float, bool]:
    """:func:`next_due_at`, and whether more than ``PILE`` due arrivals are left to fold
    (PostgreSQL): a claim folds at most ``FOLD_LIMIT`` (outbox/claim_sql.py), so an idle
    claimer with a pile left claims again at once, not a poll later each time (one query)."""
    due, now, unfolded = (await conn.execute(sql(conn).idle_outlook)).one()
    return (None if due is None else float(due)), float(now), bool(unfolded)


async def purge_batch(conn: AsyncConnection, *, older_than: float, horizon_seconds: int, limit: int) -> int:
    """Delete one batch of finished history past both the retention and its retry horizon."""
    ids = [r.id for r in await conn.execute(sql(conn).purge,
                                              {"older_than": older_than, "horizon": horizon_seconds, "limit": limit})]
    if ids:
        await conn.execute(sql(conn).purge_attempts, {"ids": ids})
    return len(ids)


async def purge_count(conn: AsyncConnection, *, older_than: float, horizon_seconds: int) -> int:
    """How many finished messages :func:`purge_batch` would delete now (``purge --dry-run``)."""
    params = {"older_than": older_than, "horizon": horizon_seconds}
    return int((await conn.execute(sql(conn).purge_count, params)).scalar_one())


async def replay(conn: AsyncConnection, ids: Sequence[int], *, force: bool, horizon_seconds: int) -> list[int]:
    """Make finished messages due again, same bytes and key, marked as a replay.

    A forced replay gets a fresh horizon from now; otherwise only messages still inside
    their horizon (counted from enqueue) are replayed.
    """
    if not ids:
        return []
    params = {"ids": list(ids), "force": force, "horizon": horizon_seconds}
    return [r.id for r in await conn.execute(sql(conn).replay, params)]


async def notify(conn: AsyncConnection) -> None:
    """Wake idle daemons now (PostgreSQL; on SQLite daemons poll)."""
    if _is_pg(conn):
        await conn.execute(text("SELECT pg_notify(:channel, '')"), {"channel": CHANNEL})
