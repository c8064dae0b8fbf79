"""Operator events: breakers, failed proofs, dying and expiring messages, keys leaving the
JWKS and a skewed clock, told to the seller's operators once per state change.

An event is a row of ``outbox_operator_events`` whose unique ``dedup_key`` names the state
change (an endpoint's trip at its open time, a key's unpublication time, a window of
deaths), written in the transaction that makes the change where there is one. Several
replicas noticing the same change insert one row: the database decides. Deaths and
expiries are counted per endpoint (and reason) into one row per window, published when the
window ends.

Maintenance publishes due rows (:func:`publish_due`): in the transaction that marks a row
published it enqueues the event through the outbox itself, as tenant
:data:`OPERATOR_TENANT`, to ``OUTBOX_OPERATOR_EVENTS_URL``: signed, retried, isolated by its
own breaker, like any webhook. After that commit it hands the event to the configured
callables (at most once each; a callable's failure is logged). Events about the operator
tenant itself are never raised, so a failing operator URL cannot feed itself.
See docs/observability.md, "Operator events".
"""

from __future__ import annotations

import asyncio
import inspect as pyinspect
import json
import math
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from sqlalchemy import select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from outbox import aio as producer
from outbox import store
from outbox.activity import rfc3339
from outbox.config import Settings
from outbox.errors import OutboxValidationError
from outbox.schema import db_now as db_clock
from outbox.schema import operator_events, signing_keys
from outbox.urls import endpoint_origin
from sinks.fanout import resolve

OPERATOR_TENANT = "outboxd-operator"
KEY_WARNING_SECONDS = 86_400.0  # a key is "nearing the end of its publication" this long before it
CLOCK_SKEW_EVENT_SECONDS = 3_600  # a host whose clock is off is reported once per hour
PUBLISH_BATCH = 100
BREAKER_KINDS = {"open": "breaker.opened", "half_open": "breaker.half_open", "closed": "breaker.closed"}
_log = structlog.get_logger("outboxd.events")


def _insert_sql(aggregate: bool) -> Any:
    """Insert an event; a second insert of the same key adds its count while it is unpublished."""
    conflict = ("DO UPDATE SET count = outbox_operator_events.count + excluded.count, last_at = excluded.last_at "
                "WHERE outbox_operator_events.published_at IS NULL") if aggregate else "DO NOTHING"
    return text("INSERT INTO outbox_operator_events (kind, dedup_key, tenant_id, origin, detail, count, first_at, "
                "last_at, due_at) VALUES (:kind, :dedup_key, :tenant_id, :origin, :detail, :count, :now, :now, :due) "
                f"ON CONFLICT (dedup_key) {conflict}")


_INSERT = {False: _insert_sql(False), True: _insert_sql(True)}  # kept: supervisor/cycle/pgdirect.py caches by identity


async def record(conn: Any, kind: str, key: str, *, now: float, tenant_id: str | None = None,
                 origin: str | None = None, detail: Mapping[str, Any] | None = None, count: int = 1,
                 window: float | None = None) -> None:
    """Raise event ``kind`` for the state change ``key`` (in the caller's transaction).

    With ``window``, the event counts every occurrence in the window ``now`` falls in and is
    published when that window ends; otherwise it is published at once, and the same ``key``
    raised again (by this or another replica) is the same event.
    """
    if tenant_id == OPERATOR_TENANT:
        return
    due = now
    if window:
        start = math.floor(now / window) * window
        key, due = f"{key}:{start:.0f}", start + window
    await conn.execute(_INSERT[bool(window)], {
        "kind": kind, "dedup_key": f"{kind}:{key}", "tenant_id": tenant_id, "origin": origin,
        "detail": json.dumps(dict(detail or {}), sort_keys=True), "count": count, "now": now, "due": due})


async def breakers_moved(conn: Any, transitions: Iterable[Mapping[str, Any]]) -> None:
    """One event per breaker transition the completer recorded (its row lock makes each once)."""
    for t in transitions:
        await record(conn, BREAKER_KINDS[t["to_state"]], f"{t['tenant_id']}:{t['origin']}:{t['occurred_at']!r}",
                     now=t["occurred_at"], tenant_id=t["tenant_id"], origin=t["origin"],
                     detail={"from_state": t["from_state"], "open_until": rfc3339(t["open_until"]),
                             "window_attempts": t["window_attempts"], "window_failures": t["window_failures"]})


async def probe_taken(conn: Any, tenant_id: str, origin: str, open_until: float | None, now: float) -> None:
    """The open period of ``open_until`` ended and a daemon took the half-open probe."""
    await record(conn, "breaker.half_open", f"{tenant_id}:{origin}:{open_until!r}", now=now, tenant_id=tenant_id,
                 origin=origin, detail={"from_state": "open"})


async def proofs_failed(conn: Any, failed: Iterable[Any], now: float) -> None:
    """Subscribers whose URL proof failed (rows of ``outbox_subscribers``, with the challenge's id)."""
    for r in failed:
        await record(conn, "subscriber.proof_failed", f"{r.id}:{r.challenge_message_id}", now=now,
                     tenant_id=r.tenant_id, origin=endpoint_origin(r.url),
                     detail={"account_id": r.account_id, "subscriber_id": r.subscriber_id})


async def messages_ended(conn: Any, dead: Iterable[tuple[str, str | None, str | None]], *, now: float,
                         window: float) -> None:
    """Count messages ended dead, per endpoint and reason, into this window's events:
    ``messages.expired`` for the retry horizon, ``messages.dead`` for every other reason."""
    for (tenant_id, origin, reason), n in sorted(Counter(dead).items(), key=lambda kv: tuple(map(str, kv[0]))):
        kind = "messages.expired" if reason == "expired" else "messages.dead"
        await record(conn, kind, f"{tenant_id}:{origin}:{reason}", now=now, tenant_id=tenant_id, origin=origin,
                     detail={"reason": reason}, count=n, window=window)


async def keys_leaving(conn: AsyncConnection, now: float) -> None:
    """A signing key whose unpublication is near (it leaves the JWKS; buyers stop accepting it)."""
    k = signing_keys.c
    rows = await conn.execute(select(k.kid, k.scope, k.adcp_use, k.unpublish_at).where(
        k.unpublish_at > now, k.unpublish_at <= now + KEY_WARNING_SECONDS, k.revoked_at.is_(None)))
    for r in rows:
        await record(conn, "key.unpublishing", f"{r.kid}:{r.unpublish_at!r}", now=now, tenant_id=r.scope or None,
                     detail={"kid": r.kid, "adcp_use": r.adcp_use, "unpublish_at": rfc3339(r.unpublish_at)})


async def clock_skewed(engine: AsyncEngine, problem: str) -> None:
    """The clock guard stopped this daemon: raised from here, since no state change carries it."""
    host = socket.gethostname()
    async with engine.begin() as conn:
        now = await store.db_now(conn)
        await record(conn, "clock.skew", host, now=now, detail={"host": host, "problem": problem},
                     window=CLOCK_SKEW_EVENT_SECONDS)
        await conn.execute(update(operator_events).where(  # due now, not at the end of the hour
            operator_events.c.dedup_key.like(f"clock.skew:{host}:%"), operator_events.c.published_at.is_(None))
            .values(due_at=now))


@dataclass(frozen=True)
class OperatorEvent:
    """A published event, as the operator URL and the callables receive it."""

    id: int
    kind: str
    tenant_id: str | None
    origin: str | None
    count: int
    first_at: float
    last_at: float
    detail: Mapping[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "event": self.kind, "tenant_id": self.tenant_id, "origin": self.origin,
                "count": self.count, "first_at": rfc3339(self.first_at), "last_at": rfc3339(self.last_at),
                "detail": dict(self.detail)}

    def summary(self) -> str:
        where = f" {self.tenant_id}@{self.origin}" if self.origin else (f" {self.tenant_id}" if self.tenant_id else "")
        extra = ", ".join(f"{k}={v}" for k, v in sorted(self.detail.items()) if v is not None)
        count = f" ×{self.count}" if self.count > 1 else ""
        return f"outboxd {self.kind}{where}{count}" + (f" ({extra})" if extra else "")


def payload(event: OperatorEvent, fmt: str) -> dict[str, Any]:
    """The body sent to the operator URL: the event as JSON, or a Slack incoming-webhook
    message (``text``; Slack ignores the ``idempotency_key`` every outboxd body carries)."""
    return {"text": event.summary()} if fmt == "slack" else {"notification_type": "operator_event", **event.as_dict()}


Sink = Callable[[dict[str, Any]], Any]


def load_sinks(paths: Sequence[str]) -> list[Sink]:
    """The callables named by ``OUTBOX_OPERATOR_EVENT_SINKS`` (dotted paths; sync or async)."""
    sinks = []
    for path in paths:
        target = resolve(path, "operator event sink")
        if not callable(target):
            raise ValueError(f"operator event sink {path!r} is not callable")
        sinks.append(target)
    return sinks


async def publish_due(engine: AsyncEngine, settings: Settings, sinks: Sequence[Sink], timeout: float = 5.0,
                      within: Callable[[Coroutine[Any, Any, bool]], Awaitable[bool | None]] | None = None) -> int:
    """Publish due events: enqueue each to the operator URL and mark it, in one transaction;
    then call the sinks. Replicas take disjoint rows (SKIP LOCKED); each row is published once.
    ``within`` runs each sink call (the daemon's: unless it is stopping, see
    ``supervisor/cycle/halting.py``); ``None`` back means the call was not made or was cut."""
    e = operator_events.c
    async with engine.connect() as conn:  # a read first: no write transaction (SQLite: lock) when idle
        if (await conn.execute(select(e.id).where(e.published_at.is_(None), e.due_at <= db_clock()).limit(1))
                ).first() is None:
            return 0
    async with engine.begin() as conn:
        now = await store.db_now(conn)
        due = select(operator_events).where(e.published_at.is_(None), e.due_at <= now).order_by(e.id) \
            .limit(PUBLISH_BATCH)
        if conn.dialect.name == "postgresql":
            due = due.with_for_update(skip_locked=True)
        events = [OperatorEvent(r.id, r.kind, r.tenant_id, r.origin, r._mapping["count"], r.first_at, r.last_at,
                                json.loads(r.detail)) for r in await conn.execute(due)]
        for event in events:
            message_id = None
            if settings.operator_events_url:
                try:
                    message_id = (await producer.enqueue(
                        conn, tenant_id=OPERATOR_TENANT, url=settings.operator_events_url,
                        payload=payload(event, settings.operator_events_format), notification_type="operator_event",
                        settings=settings)).id
                except OutboxValidationError as exc:  # the URL is refused: log it, never stall the others
                    _log.error("operator_event.unsendable", event_id=event.id, kind=event.kind, error=str(exc))
            await conn.execute(update(operator_events).where(e.id == event.id)
                               .values(published_at=now, message_id=message_id))
    for event in events:
        _log.warning("operator_event", event_id=event.id, kind=event.kind, tenant_id=event.tenant_id,
                     origin=event.origin, count=event.count)
        for sink in sinks:
            call = _call(sink, event.as_dict(), timeout)
            if await (call if within is None else within(call)) is None:
                # the daemon's stop: no transaction is under way, so nothing waits on the sinks
                _log.warning("operator_event.sink_skipped_at_stop", event_id=event.id, kind=event.kind)
    return len(events)


async def _call(sink: Sink, event: dict[str, Any], timeout: float) -> bool:
    """Call one sink: a coroutine function in the loop, any other callable in a thread.
    ``True`` once it was called, failed or not: a failure is logged, never raised."""
    try:
        if pyinspect.iscoroutinefunction(sink):
            await asyncio.wait_for(sink(event), timeout)
        else:
            await asyncio.wait_for(asyncio.to_thread(sink, event), timeout)
    except Exception as exc:  # a sink is the operator's code: its failure must not stop publishing
        _log.error("operator_event.sink_failed", sink=getattr(sink, "__name__", repr(sink)), event_id=event["id"],
                   error=type(exc).__name__)
    return True
