"""End to end from the adcp SDK's own producers: each reporting notification type, sent by outboxd.

The SDK's in-memory materializer store (its ledger, with the SDK's deterministic clock)
publishes a real revision through its public ledger API, recording
``reporting.ledger_changed`` in the same ledger transaction. The SDK's materializer service
writes and verifies that revision at its reference destination, producing
``reporting.delivery_ready``; the SDK's non-production ``ReliableReportingService`` runs that
materializer and outboxd's hand-off as its two worker extensions. The SDK's status projector
records the consumer's changed status as ``reporting.status_changed``. The SDK's
``ReportingNotificationWorker`` expands the ledger and status queues, outboxd's hand-off
stores each sealed body, ``outboxd run`` (a real daemon) sends them, and a receiver verifies
every signature with the SDK. Each body that arrives equals the one the SDK sealed and
passes the SDK's payload validation.
"""

from __future__ import annotations

import asyncio
import json
import os
from datetime import timedelta

import pytest

from adcp.reporting import ReliableReportingService
from adcp.reporting.evidence import ReportingControlTotalRecord
from adcp.reporting.ledger.models import (
    ReportingConfiguration,
    ReportingObligationRecord,
    ReportingPeriodBoundary,
    ReportingRevisionRecord,
    ReportingScheduleSpec,
)
from adcp.reporting.ledger.delivery_models import ReportingDeliveryScope
from adcp.reporting.ledger.producer import revision_content_sha256
from adcp.reporting.materializer import (
    InMemoryReportingMaterializerStore,
    ReferenceReportingDestinationWriter,
    ReferenceReportingResolver,
    ReportingDestinationBinding,
    ReportingDestinationIO,
    ReportingMaterializerService,
    ReportingObligationDeliveryRecord,
    ReportingRevisionVerifier,
    ReportingRevisionVerifierRegistry,
    reference_digest,
)
from adcp.reporting.materializer.reference import reference_verifier
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
from tests.reporting_world import (  # noqa: F401  (receiver is a fixture)
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


async def publish_revision(store: InMemoryReportingMaterializerStore, consumer: str,
                           verifier: ReportingRevisionVerifier) -> ReportingDestinationBinding:
    """One day's configuration, destination, obligation and revision, through the ledger's public API.

    The revision carries the managed evidence (canonical digest, typed control totals) a
    materialization of the SDK's reference definition needs.
    """
    schedule = ReportingScheduleSpec("P1D", "PT6H")
    definition = verifier.key.definition
    configuration = ReportingConfiguration("cfg_1", 1, ACCOUNT, consumer, "reference-report-v1", "paid_media_delivery",
                                           "pacing", schedule, "snapshot", activated_at=START - timedelta(days=2),
                                           definition=definition)
    await store.put_configuration(configuration)
    binding = ReportingDestinationBinding(configuration.generation_key, consumer, "dest_1", "trusted_1",
                                          "file_transfer", "reference-memory", "canonical_digest", "delivery_only",
                                          "pacing", 30, START, format="jsonl")
    await store.put_destination_binding(binding)
    start, end = START - timedelta(days=1), START
    due = end + timedelta(hours=6)
    obligation = ReportingObligationRecord(
        f"obl_{consumer}", ACCOUNT, consumer, "cfg_1", 1, "reference-report-v1", "paid_media_delivery", "pacing",
        ReportingPeriodBoundary("2026-11-30", start, end, "UTC", due), end, ("mb_1",), "snapshot", due, schedule,
        currency="USD", created_at=START, definition=definition)
    await store.commit_obligation(obligation)
    await store.bind_obligation_delivery(ReportingObligationDeliveryRecord(
        ReportingDeliveryScope(configuration.generation_key, consumer, obligation.reporting_obligation_id), "USD",
        START + timedelta(days=30), START))
    rows = [{"row_id": "r1", "impressions": 10, "spend": "1.50", "currency": "USD"}]
    totals = (("impressions", "10"), ("spend", "1.50"))
    evidence = (ReportingControlTotalRecord("impressions", "10", "integer"),
                ReportingControlTotalRecord("spend", "1.50", "decimal", "USD"))
    revision_id = f"rev_{consumer}"
    digest = revision_content_sha256(reporting_revision_id=revision_id, row_count=len(rows), control_totals=totals,
                                     reporting_rows=rows, control_total_evidence=evidence)
    await store.commit_revision(ReportingRevisionRecord(
        revision_id, ACCOUNT, obligation.reporting_obligation_id, "snapshot", digest, len(rows), totals, START, end,
        START, canonical_content_digest=reference_digest(verifier, rows), managed_control_totals=evidence), rows)
    return binding  # the destination the revision is materialized to


def materializer(store: InMemoryReportingMaterializerStore, binding: ReportingDestinationBinding,
                 verifier: ReportingRevisionVerifier) -> ReportingMaterializerService:
    """The SDK's materializer service, writing and verifying revisions at its reference destination."""
    writer = ReferenceReportingDestinationWriter((verifier.key.capability,))
    registry = ReportingRevisionVerifierRegistry((verifier,))
    return ReportingMaterializerService(store, ReportingDestinationIO(
        registry, ReferenceReportingResolver(writer, registry, (binding,))), writer)


async def admit_delivery_ready(store: InMemoryReportingMaterializerStore) -> None:
    """Move the ``reporting.delivery_ready`` event the materializer produced into the ledger's queue.

    The in-memory materializer keeps that event's expansion quarantined: only an account
    admitted by the SDK's production composition gets a queue that delivers it
    (docs/reporting.md, "Limits"). The event is moved unchanged, with the ledger's own
    transaction hook.
    """
    (ready,) = store._materializer_outbox.events.values()
    assert ready.notification_type == "reporting.delivery_ready"
    assert {w.state for w in store._materializer_outbox.expansions.values()} == {"quarantined"}
    async with store._mutation():
        store._record_notification(ready)


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
            store = InMemoryReportingMaterializerStore(clock=clock, notifications=True)
            status = InMemoryStatusNotificationStore(store)
            assert await status.baseline(account_id=ACCOUNT)  # the status projection starts from here
            verifier = reference_verifier()
            binding = await publish_revision(store, "buyer-a", verifier)
            cipher = ReportingEnvelopeCipher(os.urandom(32))

            def handoff(queue: InMemoryReportingOutbox) -> ReportingHandoff:
                worker = ReportingNotificationWorker(outbox=queue, subscriptions=registry, cipher=cipher, clock=clock)
                return ReportingHandoff(worker=worker, engine=pg_engine, tenant_id="t1", settings=SETTINGS, clock=clock)

            ledger_queue = InMemoryReportingOutbox(store)
            # The SDK's non-production service runs the materializer and then the hand-off as
            # its two worker extensions, once per turn.
            service = ReliableReportingService(store=store, account_context=lambda configuration: None, clock=clock,
                                               materialization_worker=materializer(store, binding, verifier),
                                               notification_worker=handoff(ledger_queue),
                                               notification_attempt_store=pg_engine)
            try:
                first = await service.run_worker()  # materialized; the revision's event handed off
                assert not first.extension_errors and first.extension_results[0].state == "verified"
                await admit_delivery_ready(store)
                second = await service.run_worker()  # the materialization's event handed off
                assert not second.extension_errors
            finally:
                await service.close()
            results = first.extension_results[1] + second.extension_results[1]
            status_turn = await ReportingStatusProjector(status).run_once(account_id=ACCOUNT)
            assert (status_turn.did_work, status_turn.events) == (True, 1)  # the obligation's health changed once
            results += await handoff(status.outbox).run_once()
            bodies: dict[str, bytes] = {}
            for queue in (ledger_queue, status.outbox):
                bodies.update(await sealed_bodies(queue, cipher))
            assert sorted(r.idempotency_key for r in results if r.state == "complete") == sorted(bodies)
            assert {json.loads(b).get("reporting_revision_id") for b in bodies.values()} >= {"rev_buyer-a"}
            return bodies

        bodies = asyncio.run(produce_and_hand_off())
        assert procs.wait_until(lambda: message_count(pg_engine) == len(TYPES) and settled(pg_engine), 60)
    finally:
        assert procs.stop(daemon) == 0
    seen = {a["key"]: a for a in procs.arrivals(log) if a["path"] == "/ok/svc-a" and a["type"] in TYPES}
    assert set(seen) == set(bodies)
    for idempotency_key, body in bodies.items():
        arrival = seen[idempotency_key]
        assert arrival["verified"] and arrival["status"] == 200
        assert arrival["body"].encode() == body  # the SDK's exact bytes
        validate_notification_payload(json.loads(arrival["body"]))
    assert sorted(json.loads(b)["notification_type"] for b in bodies.values()) == sorted(TYPES)  # one of each
