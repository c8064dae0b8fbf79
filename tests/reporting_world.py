"""The seller's side of the Reliable Reporting end-to-end tests: one account, its buyers'
registrations, the SDK's ledger events and clock, and one verifying receiver per module.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest
from sqlalchemy import func, select

import outbox
from adcp.reporting.ledger import InMemoryReportingLedgerStore
from adcp.reporting.ledger.models import ReportingConfigurationGenerationKey
from adcp.reporting.ledger.notification_models import (
    MaterializationReady,
    ReportingStatusScope,
    RevisionPublished,
    StatusChanged,
    new_event,
)
from adcp.reporting.outbox import (
    InMemoryReportingOutbox,
    ReportingEnvelopeCipher,
    ReportingNotificationSubscription,
    validate_notification_payload,
)
from outbox.db import libpq_url
from outbox.schema import messages, subscribers
from tests import procs
from tests.ledger import THROWAWAY_KEY, loopback_producer

ACCOUNT = "acct_glow"
TYPES = ("reporting.delivery_ready", "reporting.ledger_changed", "reporting.status_changed")
LEDGER = "reporting.ledger_changed"
KEY = THROWAWAY_KEY
SETTINGS = loopback_producer(OUTBOX_SELLER_AGENT_URL="https://seller.example/adcp", OUTBOX_ENCRYPTION_KEY=KEY)
START = datetime(2026, 12, 1, 10, tzinfo=timezone.utc)
EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"  # the hand-off factory, reporting_handoff:build


def with_example_handoff(env: dict[str, str], tenant: str = "t1") -> dict[str, str]:
    """``env`` (a daemon's) running the example hand-off factory for ``tenant``."""
    return {**env, "OUTBOX_REPORTING_HANDOFF": "reporting_handoff:build", "REPORTING_TENANT_ID": tenant,
            "REPORTING_CIPHER_KEY": "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=",
            "PYTHONPATH": os.pathsep.join([str(EXAMPLES), env.get("PYTHONPATH", "")])}


def create_sdk_queues(pg_url: str) -> None:
    """The SDK's PostgreSQL reporting queues (ledger and status), in ``pg_url``'s database."""
    from adcp_reporting_storage.outbox.pg import PgReportingOutbox
    from adcp_reporting_storage.outbox.status_pg import PgReportingStatusOutbox
    from psycopg_pool import AsyncConnectionPool

    async def create() -> None:
        conninfo = libpq_url(pg_url)
        async with AsyncConnectionPool(conninfo, min_size=1, max_size=1) as pool:
            await PgReportingOutbox(pool=pool).create_schema()
            await PgReportingStatusOutbox(pool=pool).create_schema()

    asyncio.run(create())


class Clock:
    """The SDK's clock, moved by the test (leases lapse when the test says so)."""

    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now


class Registry:
    """The seller's trusted registrations, as the SDK's subscription resolver reads them."""

    def __init__(self) -> None:
        self.subscriptions: dict[str, ReportingNotificationSubscription] = {}

    def add(self, subscriber_id: str, principal_id: str, event_types: tuple[str, ...]) -> None:
        self.subscriptions[subscriber_id] = ReportingNotificationSubscription(
            ACCOUNT, subscriber_id, principal_id, f"https://{subscriber_id}.buyer.example/reporting", event_types,
            "rev-1", "authz-1", "proof-1", signing_scope_id="scope-1", active=True, authorized=True,
            proof_valid=True)

    async def list_active(self, *, account_id: str, notification_type: str):
        return tuple(s for s in self.subscriptions.values() if notification_type in s.event_types)

    async def get_active(self, *, account_id: str, subscriber_id: str, notification_type: str):
        return self.subscriptions.get(subscriber_id)


def register(engine, sid: str, principal: str, url: str, event_types=TYPES, tenant: str = "t1") -> None:
    """Register buyer ``sid`` (principal ``principal``) for ``event_types`` at ``url``."""
    with engine.begin() as conn:
        outbox.register_subscriber(conn, tenant_id=tenant, account_id=ACCOUNT, principal_id=principal,
                                   notification_config={"subscriber_id": sid, "url": url,
                                                        "event_types": list(event_types)}, settings=SETTINGS)


def prove_all(engine) -> None:
    """Every subscriber's URL proof settled (the daemon's part; tests/test_reporting_e2e.py runs it)."""
    with engine.begin() as conn:
        conn.execute(subscribers.update().values(state="active", proven_sha256=subscribers.c.config_sha256))


def ledger_body(subscriber_id: str, key: str | None = None, **changes) -> bytes:
    """A ``reporting.ledger_changed`` body for ``subscriber_id``, as the SDK renders one (its
    own payload validation passes it)."""
    body = {"account_id": ACCOUNT, "change_kind": "revision_published", "finality": "snapshot",
            "fired_at": "2026-12-01T10:00:00Z", "idempotency_key": key or str(uuid.uuid4()),
            "notification_id": "evt_1", "notification_type": LEDGER, "reporting_revision_id": "rev_1",
            "subscriber_id": subscriber_id, **changes}
    validate_notification_payload(body)
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def causes(consumer: str) -> list:
    """One cause of each reporting notification type for ``consumer``."""
    generation = ReportingConfigurationGenerationKey(ACCOUNT, consumer, "cfg_1", 1)
    return [RevisionPublished(f"rev_{consumer}", consumer, "snapshot"),
            StatusChanged(ReportingStatusScope(ACCOUNT, generation, feed_purpose="pacing"), "healthy", "a" * 64, 1),
            MaterializationReady(generation, consumer, "obl_1", "dest_1", "file_transfer", f"rev_{consumer}",
                                 "mat_1", "available", "snapshot", START, "pacing")]


async def record(store: InMemoryReportingLedgerStore, *items) -> None:
    """Events written in one ledger transaction, as the SDK's ledger writes them."""
    async with store._mutation():
        for cause in items:
            store._record_notification(new_event(ACCOUNT, cause, START))


async def sealed_bodies(queue: InMemoryReportingOutbox, cipher: ReportingEnvelopeCipher) -> dict[str, bytes]:
    """Every expanded delivery's exact body, by idempotency key (opened with the SDK's cipher)."""
    return {d.delivery.binding.idempotency_key: cipher.open(d.delivery).prepared.body
            for d in await queue.list_deliveries(account_id=ACCOUNT)}


def message_count(engine) -> int:
    """The reporting notifications in the outbox."""
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(messages)
                            .where(messages.c.notification_type.in_(TYPES))).scalar_one()


def listed(engine) -> list[outbox.Subscriber]:
    """The account's registered subscribers."""
    with engine.connect() as conn:
        return outbox.list_subscribers(conn, tenant_id="t1", account_id=ACCOUNT)


def settled(engine) -> bool:
    """Whether there are messages and every one is delivered or dead."""
    with engine.connect() as conn:
        states = conn.execute(select(messages.c.state)).scalars().all()
    return bool(states) and all(s in ("delivered", "dead") for s in states)


@pytest.fixture(scope="module")
def receiver(tmp_path_factory):
    """One verifying receiver for the file (starting the SDK's verifier is the slow part)."""
    directory = tmp_path_factory.mktemp("receiver")
    key, jwks = procs.make_key(directory)
    with procs.receiver(directory, jwks, log_bodies=True) as (port, log):
        yield key, f"http://127.0.0.1:{port}", log, jwks
