"""End to end from the adcp SDK's own producers: a revision and a status change, sent by outboxd.

Nothing here writes a reporting event by hand. The SDK's in-memory ledger (its deterministic
clock) publishes a real revision through its public ledger API, which records
``reporting.ledger_changed`` in the same ledger transaction; the SDK's status projector then
projects the consumer's changed status and records ``reporting.status_changed`` in its status
queue. The SDK's ``ReportingNotificationWorker`` expands both queues, outboxd's hand-off stores
each sealed body, ``outboxd run`` (a real daemon) sends them, and a receiver verifies every
signature with the SDK. Each body that arrives equals the one the SDK sealed and passes the
SDK's payload validation.
"""

from __future__ import annotations

import asyncio
import json
import os
from datetime import timedelta

import pytest

from adcp.reporting.ledger import InMemoryReportingLedgerStore
from adcp.reporting.ledger.models import (
    ReportingConfiguration,
    ReportingObligationRecord,
    ReportingPeriodBoundary,
    ReportingRevisionRecord,
    ReportingScheduleSpec,
)
from adcp.reporting.ledger.producer import revision_content_sha256
from adcp.reporting.outbox import (
    InMemoryReportingOutbox,
    ReportingEnvelopeCipher,
    ReportingNotificationWorker,
    validate_notification_payload,
)
from adcp.reporting.outbox.status import ReportingStatusProjector
from adcp.reporting.outbox.status_memory import InMemoryStatusNotificationStore
from adcp.reporting.testing import DeterministicReportingClock
from outbox.reporting import ReportingHandoff
from tests import procs
from tests.test_reporting_e2e import (  # noqa: F401  (receiver is a fixture)
    ACCOUNT,
    KEY,
    SETTINGS,
    START,
    TYPES,
    Registry,
    listed,
    message_count,
    receiver,
    register,
    sealed_bodies,
    settled,
)

pytestmark = pytest.mark.e2e
PRODUCED = ("reporting.ledger_changed", "reporting.status_changed")


async def publish_revision(store: InMemoryReportingLedgerStore, consumer: str) -> str:
    """One day's configuration, obligation and snapshot revision, through the ledger's public API."""
    schedule = ReportingScheduleSpec("P1D", "PT6H")
    await store.put_configuration(ReportingConfiguration(
        "cfg_1", 1, ACCOUNT, consumer, "def_1", "core", "pacing", schedule, "snapshot",
        activated_at=START - timedelta(days=2)))
    start, end = START - timedelta(days=1), START
    due = end + timedelta(hours=6)
    obligation = ReportingObligationRecord(
        f"obl_{consumer}", ACCOUNT, consumer, "cfg_1", 1, "def_1", "core", "pacing",
        ReportingPeriodBoundary("2026-11-30", start, end, "UTC", due), end, ("mb_1",), "snapshot", due, schedule,
        currency="USD", created_at=START)
    await store.commit_obligation(obligation)
    revision_id = f"rev_{consumer}"
    digest = revision_content_sha256(reporting_revision_id=revision_id, row_count=0, control_totals=(),
                                     reporting_rows=())
    await store.commit_revision(ReportingRevisionRecord(
        revision_id, ACCOUNT, obligation.reporting_obligation_id, "snapshot", digest, 0, (), START, end, START), ())
    return revision_id


def test_the_sdk_producers_events_arrive_as_the_sdk_sealed_them(pg_engine, pg_url, tmp_path, receiver):
    key, base, log, _ = receiver
    register(pg_engine, "svc-a", "buyer-a", f"{base}/ok/svc-a")
    registry = Registry()
    registry.add("svc-a", "buyer-a", TYPES)
    env = procs.daemon_env(pg_url, key, seller_agent_url=SETTINGS.seller_agent_url, encryption_key=KEY)
    daemon = procs.start_daemon(env, tmp_path / "d.log")
    try:
        assert procs.wait_until(lambda: {s.state for s in listed(pg_engine)} == {"active"}, 60)

        async def produce_and_hand_off() -> dict[str, bytes]:
            clock = DeterministicReportingClock(START)
            store = InMemoryReportingLedgerStore(clock=clock, notifications=True)
            status = InMemoryStatusNotificationStore(store)
            assert await status.baseline(account_id=ACCOUNT)  # the status projection starts from here
            revision_id = await publish_revision(store, "buyer-a")
            turn = await ReportingStatusProjector(status).run_once(account_id=ACCOUNT)
            assert (turn.did_work, turn.events) == (True, 1)  # the obligation's health changed once
            cipher = ReportingEnvelopeCipher(os.urandom(32))
            bodies: dict[str, bytes] = {}
            for queue in (InMemoryReportingOutbox(store), status.outbox):  # the ledger's queue, the status queue
                worker = ReportingNotificationWorker(outbox=queue, subscriptions=registry, cipher=cipher, clock=clock)
                results = await ReportingHandoff(worker=worker, engine=pg_engine, tenant_id="t1", settings=SETTINGS,
                                                 clock=clock).run_once()
                assert [r.state for r in results] == ["complete"]
                bodies.update(await sealed_bodies(queue, cipher))
            assert json.loads(bodies[results[0].idempotency_key])["notification_type"] == "reporting.status_changed"
            assert revision_id in {json.loads(b).get("reporting_revision_id") for b in bodies.values()}
            return bodies

        bodies = asyncio.run(produce_and_hand_off())
        assert procs.wait_until(lambda: message_count(pg_engine) == 2 and settled(pg_engine), 60)
    finally:
        assert procs.stop(daemon) == 0
    seen = {a["key"]: a for a in procs.arrivals(log) if a["path"] == "/ok/svc-a" and a["type"] in TYPES}
    assert set(seen) == set(bodies)
    for idempotency_key, body in bodies.items():
        arrival = seen[idempotency_key]
        assert arrival["verified"] and arrival["status"] == 200
        assert arrival["body"].encode() == body  # the SDK's exact bytes
        validate_notification_payload(json.loads(arrival["body"]))
    assert sorted(json.loads(b)["notification_type"] for b in bodies.values()) == list(PRODUCED)
