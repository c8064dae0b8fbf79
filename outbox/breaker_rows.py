"""The statements of the breaker rows: ``outbox_breakers``, one row per endpoint (tenant,
origin), and ``outbox_breaker_transitions``, one row per move between states.

The completer folds each batch's outcomes into these rows (supervisor/cycle/completer.py),
the claimer takes an endpoint's half-open probe (supervisor/cycle/claimer.py), and the claim
statement reads them (outbox/claim_sql.py). The message state machine is outbox/store.py;
the breaker's own rules are supervisor/cycle/breaker.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import ColumnElement, TextClause, and_, case, literal_column, text, tuple_
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox.schema import PG_NOW, SQLITE_NOW, breaker_transitions, breakers

__all__ = ["BREAKER_COLUMNS", "acquire_probe", "ensure_breakers", "insert_transitions", "lock_breakers",
           "holding_back", "save_breakers", "shown_columns", "state_now"]

BREAKER_COLUMNS = ("state", "failures", "successes", "trips", "open_until", "probe_until", "updated_at",
                   "window_started_at", "window_attempts", "window_failures", "previous_attempts",
                   "previous_failures")


def _probe_statement(now: str) -> TextClause:
    # Successes restart only when the open period ends: half-open takes one probe at a
    # time, so the successes that close the breaker accumulate across probes.
    return text(f"""
        UPDATE outbox_breakers SET state = 'half_open',
            successes = CASE WHEN state = 'open' THEN 0 ELSE successes END,
            probe_until = {now} + :lease, updated_at = {now}
        WHERE tenant_id = :tenant_id AND origin = :origin
          AND ((state = 'open' AND open_until <= {now})
               OR (state = 'half_open' AND (probe_until IS NULL OR probe_until <= {now})))
    """)


_ACQUIRE_PROBE = {True: _probe_statement(PG_NOW), False: _probe_statement(SQLITE_NOW)}  # by "is PostgreSQL"
# The probe's lease cut short to now (not NULL): a shorter lease is what the breakers'
# trigger (migration 0014) watches for, and it makes the endpoint due again for the claim.
_RETURN_PROBE = {pg: text(f"UPDATE outbox_breakers SET probe_until = {now} WHERE tenant_id = :tenant_id "
                          f"AND origin = :origin AND state = 'half_open' AND probe_until > {now}")
                 for pg, now in ((True, PG_NOW), (False, SQLITE_NOW))}
_PROBED = "SELECT state FROM outbox_breakers WHERE tenant_id = :tenant_id AND origin = :origin"
_PROBED_STATE = {True: text(_PROBED + " FOR UPDATE"), False: text(_PROBED)}  # SQLite: its write lock is held


def _pg(conn: AsyncConnection) -> bool:
    return conn.dialect.name == "postgresql"


def state_now(conn: AsyncConnection) -> ColumnElement[str]:
    """A breaker's state as it acts now, labelled ``state``: an open breaker whose open period
    has ended admits a probe, so it is half-open, though its row says ``open`` until the claim
    takes that probe (and an endpoint nothing is sent to any more never takes one). What the
    gauge, ``breakers list``, ``status``, ``endpoints`` and the console show."""
    now: ColumnElement[float] = literal_column(f"({PG_NOW if _pg(conn) else SQLITE_NOW})")
    lapsed = and_(breakers.c.state == "open", breakers.c.open_until <= now)
    return case((lapsed, "half_open"), else_=breakers.c.state).label("state")


# Breakers not closed that pending messages wait behind (each probe read from the pending
# endpoint index: the cost is the breakers not closed, not the backlog).
_HOLDING_BACK = text("""
    SELECT count(*) FROM outbox_breakers AS b
    WHERE b.state <> 'closed' AND EXISTS (
        SELECT 1 FROM outbox_messages AS m
        WHERE m.state = 'pending' AND m.tenant_id = b.tenant_id AND COALESCE(m.origin, '') = b.origin)
""")


async def holding_back(conn: AsyncConnection) -> int:
    """Endpoints whose pending messages an open or half-open breaker holds back: a breaker an
    endpoint nothing waits for any more defers nothing, whatever its row says."""
    return int((await conn.execute(_HOLDING_BACK)).scalar_one())


def shown_columns(conn: AsyncConnection) -> list[Any]:
    """Every column of ``outbox_breakers``, the state as :func:`state_now` reads it."""
    return [state_now(conn) if c.name == "state" else c for c in breakers.c]


def _insert(conn: AsyncConnection) -> Any:
    """The dialect's ``insert`` (both have ``on_conflict_do_*``)."""
    return (postgresql if _pg(conn) else sqlite).insert


async def lock_breakers(conn: AsyncConnection, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    """Breaker rows for ``keys`` (tenant, origin), locked in key order (no deadlocks)."""
    wanted = sorted(set(keys))
    if not wanted:
        return {}
    query = breakers.select().where(tuple_(breakers.c.tenant_id, breakers.c.origin).in_(wanted))
    if _pg(conn):
        query = query.order_by(breakers.c.tenant_id, breakers.c.origin).with_for_update()
    rows = (await conn.execute(query)).mappings().all()
    return {(r["tenant_id"], r["origin"]): dict(r) for r in rows}


async def ensure_breakers(conn: AsyncConnection, keys: Iterable[tuple[str, str]]) -> None:
    """Create missing breaker rows (closed, empty), leaving existing ones alone.

    Run before :func:`lock_breakers`, so two daemons recording the first failures of an
    endpoint at once both lock the same row and the second adds to the first's counts
    (PostgreSQL makes the second INSERT wait for the first to commit) instead of both
    starting from nothing and the later write erasing the earlier.
    """
    rows = [{"tenant_id": t, "origin": o} for t, o in sorted(set(keys))]
    if rows:
        await conn.execute(_insert(conn)(breakers).on_conflict_do_nothing(index_elements=["tenant_id", "origin"]),
                           rows)


async def save_breakers(conn: AsyncConnection, rows: Sequence[dict[str, Any]]) -> None:
    """Upsert breaker rows (one statement per batch, whatever the number of keys)."""
    if not rows:
        return
    statement = _insert(conn)(breakers)
    statement = statement.on_conflict_do_update(
        index_elements=["tenant_id", "origin"], set_={c: statement.excluded[c] for c in BREAKER_COLUMNS}
    )
    await conn.execute(statement, [{k: row[k] for k in ("tenant_id", "origin", *BREAKER_COLUMNS)} for row in rows])


async def insert_transitions(conn: AsyncConnection, rows: Sequence[dict[str, Any]]) -> None:
    """Record breaker moves (``breaker.transition``), one row each."""
    if rows:
        await conn.execute(breaker_transitions.insert(), list(rows))


async def return_probes(conn: AsyncConnection, endpoints: Sequence[tuple[str, str]]) -> None:
    """Give back the half-open probes of these endpoints, taken for messages that were not sent
    (held for a signing key, past their horizon, handed back): the next claim may take the probe
    at once, rather than when the probe's lease would have ended."""
    if endpoints:
        await conn.execute(_RETURN_PROBE[_pg(conn)], [{"tenant_id": t, "origin": o} for t, o in sorted(set(endpoints))])


async def acquire_probe(conn: AsyncConnection, tenant_id: str, origin: str, lease_seconds: float) -> str | None:
    """Take the single half-open probe of a breaker whose open period is over: the state it
    moved from (``open``, a transition to record; ``half_open``, an earlier probe's lease had
    lapsed), or ``None`` when another daemon holds the probe. The row is read locked first
    (one more statement, once per open period)."""
    key = {"tenant_id": tenant_id, "origin": origin}
    before = next((row[0] for row in await conn.execute(_PROBED_STATE[_pg(conn)], key)), None)
    result = await conn.execute(_ACQUIRE_PROBE[_pg(conn)], {**key, "lease": lease_seconds})
    return before if result.rowcount == 1 else None
