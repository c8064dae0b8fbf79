"""The reporting hand-off: the ``adcp`` SDK's Reliable Reporting deliveries, sent by outboxd.

The SDK's ledger writes each reporting event in its own transaction, and its
``ReportingNotificationWorker.expand_one`` turns an event into one sealed delivery per
matching subscription (fresh ``idempotency_key``, exact body bytes). Instead of its
``deliver_one`` (a fixed retry, no back-off, no breaker), :class:`ReportingHandoff` claims
each delivery, opens it with the SDK's cipher, stores the body into outboxd for the
subscriber outboxd knows under the same ``(account, subscriber_id)`` and principal, commits,
and only then finishes the SDK delivery.

Exactly one outboxd message per SDK delivery: the message's identity is ``(tenant,
idempotency_key)`` and the body is the same bytes, so a hand-off repeated after a crash
between the commit and the finish (or by a second worker once the lease lapsed) returns the
stored message instead of writing another (docs/reporting.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from outbox.config import Settings
from outbox.db import bound_idle_in_transaction
from outbox.errors import ConfigurationError, IdempotencyConflictError, OutboxValidationError
from outbox.events import SubscriberUnavailable, enqueue_subscriber_body
from outbox.producer import default_settings


class ExpandingWorker(Protocol):
    """What the hand-off uses of the SDK's ``ReportingNotificationWorker``: its outbox (the
    delivery queue), its envelope cipher, and its expansion, which stays the SDK's own."""

    outbox: Any
    cipher: Any

    async def expand_one(self, *, account_id: str) -> bool: ...


@dataclass(frozen=True)
class HandoffResult:
    """One claimed SDK delivery and what became of it."""

    delivery_id: str
    idempotency_key: str
    state: str  # the SDK state it was finished with: complete | pending | suppressed | quarantined
    message_id: int | None  # the outboxd message (None when nothing was stored)
    finished: bool  # False: the SDK lease lapsed first; the next claim hands it off again (same message)
    error: str | None = None  # the SDK error code it was finished with (integrity_failure, network, ...)


@dataclass(frozen=True)
class Backlog:
    """SDK work not yet in outboxd: events not yet expanded, deliveries not yet handed off;
    and the deliveries quarantined, which never will be (sealed under another cipher key, or
    a body outboxd refuses)."""

    expansions: int
    deliveries: int
    quarantined: int = 0


# adcp-reporting-storage's queue tables: <prefix>expansions and <prefix>deliveries, where
# leased rows are unfinished too.
PG_LEDGER_QUEUE = "reporting_notification_"  # PgReportingOutbox: revisions, adjustments, delivery_ready
PG_STATUS_QUEUE = "reporting_status_notification_"  # PgReportingStatusOutbox: status_changed
_PG_BACKLOG = ("SELECT (SELECT count(*) FROM {0}expansions WHERE state IN ('pending', 'leased')),"
               " (SELECT count(*) FROM {0}deliveries WHERE state IN ('pending', 'leased')),"
               " (SELECT count(*) FROM {0}deliveries WHERE state = 'quarantined')")


def pg_backlog(pool: Any, queue: str = PG_LEDGER_QUEUE) -> Callable[[], Awaitable[Backlog]]:
    """The backlog of one of the SDK's PostgreSQL reporting queues (``adcp-reporting-storage``),
    read through its ``psycopg_pool.AsyncConnectionPool``."""
    if queue not in (PG_LEDGER_QUEUE, PG_STATUS_QUEUE):
        raise ValueError(f"{queue!r} is not one of the SDK's reporting queues")
    query = _PG_BACKLOG.format(queue)

    async def backlog() -> Backlog:
        async with pool.connection() as conn:
            row = await (await conn.execute(query)).fetchone()
        return Backlog(int(row[0]), int(row[1]), int(row[2]))

    return backlog


class ReportingHandoff:
    """Hand one tenant's SDK reporting deliveries to outboxd, in place of the SDK's sending.

    ``worker`` is the SDK's ``ReportingNotificationWorker`` (its outbox, cipher and
    subscription resolver); ``engine`` is outboxd's database. :meth:`run_once` is the
    ``notification_worker`` turn the SDK's non-production service calls, or the turn of the
    loop ``outboxd run`` drives (docs/reporting.md). ``backlog`` (e.g. :func:`pg_backlog`)
    feeds the metric and ``outboxd reporting``; ``close`` releases the seller's resources.
    Several hand-offs may run at once: the SDK's delivery lease keeps them apart, and the
    idempotency key settles a lapsed one.
    """

    def __init__(self, *, worker: ExpandingWorker, engine: Engine, tenant_id: str,
                 settings: Settings | None = None, clock: Callable[[], datetime] | None = None,
                 lease_seconds: float = 60, retry_seconds: float = 5,
                 backlog: Callable[[], Awaitable[Backlog]] | None = None,
                 close: Callable[[], Awaitable[None]] | None = None) -> None:
        if lease_seconds < 1 or retry_seconds <= 0:
            raise ValueError("positive retry and at least one second of lease are required")
        self.worker, self.engine, self.tenant_id = worker, engine, tenant_id
        self.queue, self.cipher = worker.outbox, worker.cipher
        self.settings = settings or default_settings()
        self._clock = clock or (lambda: datetime.now(timezone.utc))
        self.lease_seconds, self.retry_seconds = lease_seconds, retry_seconds
        self._backlog, self._close = backlog, close

    async def backlog(self) -> Backlog | None:
        """What is still waiting in the SDK's queues (``None``: the queue cannot say)."""
        return None if self._backlog is None else await self._backlog()

    async def aclose(self) -> None:
        """Release what the seller's factory opened for this hand-off (its pools)."""
        if self._close is not None:
            await self._close()

    def commit_message(self, binding: Any, body: bytes) -> int:
        """Commit the outboxd message for one opened delivery (its own transaction, which the
        server ends if a black hole cuts it off: :func:`outbox.db.bound_idle_in_transaction`;
        else the message's key stays taken and the delivery's next hand-off waits on it)."""
        with self.engine.begin() as conn:
            bound_idle_in_transaction(conn, self.settings)
            return enqueue_subscriber_body(conn, tenant_id=self.tenant_id, account_id=binding.account_id,
                                           subscriber_id=binding.subscriber_id, principal_id=binding.principal_id,
                                           body=body, settings=self.settings).id

    async def _outcome(self, lease: Any) -> tuple[str, str | None, int | None]:
        try:
            opened = self.cipher.open(lease.delivery)
        except ValueError:  # ReportingNotificationError: tampered or undecodable, never sendable
            return "quarantined", "integrity_failure", None
        try:
            message_id = await asyncio.to_thread(self.commit_message, lease.delivery.binding, opened.prepared.body)
        except SubscriberUnavailable:
            return "suppressed", "subscription_changed", None
        except IdempotencyConflictError:
            # The key is already stored with another destination (the subscriber's URL
            # changed after an earlier hand-off committed): that message is this delivery's.
            return "complete", None, None
        except ConfigurationError:  # e.g. a legacy credential and no OUTBOX_ENCRYPTION_KEY: fixable
            return "pending", "invalid_configuration", None
        except OutboxValidationError:  # a body outboxd refuses: never sendable, and must not stall the rest
            return "quarantined", "invalid_payload", None
        except SQLAlchemyError:
            return "pending", "network", None  # outboxd's database is unreachable: try again later
        return "complete", None, message_id

    async def hand_off_one(self, *, account_id: str) -> HandoffResult | None:
        """Claim one due delivery of ``account_id`` and hand it off; ``None`` when none is due."""
        lease = await self.queue.claim_delivery(account_id=account_id, now=self._clock(),
                                                lease_seconds=self.lease_seconds)
        if lease is None:
            return None
        state, error, message_id = await self._outcome(lease)
        now = self._clock()
        retry_at = now + timedelta(seconds=self.retry_seconds) if state == "pending" else None
        finished = await self.queue.finish_delivery(lease, now=now, state=state, error_code=error, retry_at=retry_at)
        binding = lease.delivery.binding
        return HandoffResult(binding.delivery_id, binding.idempotency_key, state, message_id, finished, error)

    async def _due_account(self, *, delivery: bool) -> str | None:
        return await self.queue.next_due_account(delivery=delivery, now=self._clock())

    async def run_once(self) -> list[HandoffResult]:
        """Expand every due event (the SDK's expansion) and hand off every due delivery.

        The SDK's queues name the next account with due work, so no account list is needed.
        A delivery the hand-off leaves pending is due again only after ``retry_seconds``.
        """
        while (account := await self._due_account(delivery=False)) is not None:
            if not await self.worker.expand_one(account_id=account):
                break  # another worker claimed it first
        results: list[HandoffResult] = []
        while (account := await self._due_account(delivery=True)) is not None:
            result = await self.hand_off_one(account_id=account)
            if result is None:
                break
            results.append(result)
        return results
