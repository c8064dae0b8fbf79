"""End to end: the adcp SDK's Reliable Reporting notifications, handed off to and sent by outboxd.

The SDK's in-memory ledger (deterministic clock) records one event of each reporting type
for buyer A and a revision for buyer B; the SDK's own ``ReportingNotificationWorker``
expands them with its cipher; :class:`outbox.reporting.ReportingHandoff` moves each sealed
delivery into outboxd (PostgreSQL), and the real daemon sends them to a receiver that
verifies every signature with the SDK. Checked: exact body bytes and the SDK's payload
validation, 503-503-200 as three attempts under one key, a crash between outboxd's commit
and the SDK finish, two hand-off workers at once, principal scoping, and revocation.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

import outbox
from adcp.reporting import ReliableReportingService
from adcp.reporting.ledger import InMemoryReportingLedgerStore
from adcp.reporting.ledger.notification_models import RevisionPublished, StatusChanged, new_event
from adcp.reporting.outbox import (
    InMemoryReportingOutbox,
    ReportingEnvelopeCipher,
    ReportingNotificationWorker,
    validate_notification_payload,
)
from outbox.db import libpq_url
from outbox.reporting import ReportingHandoff
from outbox.schema import attempts, messages
from supervisor import cli
from tests import procs
from tests.reporting_world import (ACCOUNT, EXAMPLES, KEY, LEDGER, SETTINGS, START, TYPES, Clock, Registry, causes,
                                   listed, message_count, record, register, sealed_bodies, settled,
                                   with_example_handoff)
from tests.reporting_world import receiver  # noqa: F401 - a pytest fixture

pytestmark = pytest.mark.e2e
def test_reporting_notifications_handed_off_and_delivered(pg_engine, pg_url, tmp_path, receiver):
    key, base, log, _ = receiver
    register(pg_engine, "sub-a", "buyer-a", f"{base}/flaky/2/503/a")  # 503, 503, then 200 for every key
    register(pg_engine, "sub-b", "buyer-b", f"{base}/ok/b")
    register(pg_engine, "sub-c", "buyer-a", f"{base}/ok/c", ("reporting.ledger_changed",))
    registry = Registry()
    registry.add("sub-a", "buyer-a", TYPES)
    registry.add("sub-b", "buyer-b", TYPES)
    registry.add("sub-c", "buyer-a", ("reporting.ledger_changed",))
    # sub-a's 503s open the origin's breaker (one receiver serves every buyer): keep it open briefly.
    env = procs.daemon_env(pg_url, key, proof_max_attempts=5, seller_agent_url=SETTINGS.seller_agent_url,
                           encryption_key=KEY, breaker_open_seconds=1)
    daemon = procs.start_daemon(env, tmp_path / "proofs.log")  # the buyers prove their URLs first
    try:
        assert procs.wait_until(lambda: {s.state for s in listed(pg_engine)} == {"active"}, 60)
    finally:
        assert procs.stop(daemon) == 0
    clock = Clock()
    store = InMemoryReportingLedgerStore(clock=clock, notifications=True)
    queue = InMemoryReportingOutbox(store)
    cipher = ReportingEnvelopeCipher(os.urandom(32))
    worker = ReportingNotificationWorker(outbox=queue, subscriptions=registry, cipher=cipher, clock=clock)
    handoff = ReportingHandoff(worker=worker, engine=pg_engine, tenant_id="t1", settings=SETTINGS, clock=clock,
                               lease_seconds=30)

    async def hand_off() -> dict[str, bytes]:
        await record(store, *causes("buyer-a"), causes("buyer-b")[0])
        while await worker.expand_one(account_id=ACCOUNT):  # the SDK's expansion, unchanged
            pass
        bodies = await sealed_bodies(queue, cipher)
        # A crash after outboxd committed and before the SDK finish: the lease lapses, the
        # delivery is claimed again and handed off again.
        lease = await queue.claim_delivery(account_id=ACCOUNT, now=clock(), lease_seconds=30)
        opened = cipher.open(lease.delivery)
        first = handoff.commit_message(lease.delivery.binding, opened.prepared.body)
        clock.now += timedelta(seconds=31)
        # Two hand-off workers at once over the same queue.
        twin = ReportingHandoff(worker=worker, engine=pg_engine, tenant_id="t1", settings=SETTINGS, clock=clock,
                                lease_seconds=30)
        results = [r for batch in await asyncio.gather(handoff.run_once(), twin.run_once()) for r in batch]
        assert {r.state for r in results} == {"complete"} and all(r.finished for r in results)
        assert sorted(r.idempotency_key for r in results) == sorted(bodies)
        again = next(r for r in results if r.idempotency_key == lease.delivery.binding.idempotency_key)
        assert again.message_id == first  # the stored record, not a second message
        return bodies

    bodies = asyncio.run(hand_off())
    assert len(bodies) == 5  # buyer A: three to sub-a, one to sub-c; buyer B: its revision to sub-b
    assert message_count(pg_engine) == len(bodies)
    assert all(s.state == "complete" for s in asyncio.run(queue.list_deliveries(account_id=ACCOUNT)))

    # Revoked after the hand-off: its pending message ends `cancelled`, and a later event
    # for it is suppressed in the SDK instead of handed off.
    with pg_engine.begin() as conn:
        assert outbox.remove_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, subscriber_id="sub-c")
    with pg_engine.connect() as conn:
        cancelled = conn.execute(select(messages.c.state, messages.c.dead_reason)
                                 .where(messages.c.subscriber_id == "sub-c",
                                        messages.c.notification_type.in_(TYPES))).all()
    assert [tuple(r) for r in cancelled] == [("dead", "cancelled")]

    async def after_revocation() -> list:
        await record(store, RevisionPublished("rev_buyer-a_2", "buyer-a", "snapshot",
                                              supersedes_reporting_revision_id="rev_buyer-a"))
        # The SDK's non-production service drives the hand-off as its notification worker
        # (it only checks that an attempt store is given: outboxd's attempt log is that).
        service = ReliableReportingService(store=store, account_context=lambda configuration: None, clock=clock,
                                           notification_worker=handoff, notification_attempt_store=pg_engine)
        try:
            turn = await service.run_worker()
        finally:
            await service.close()
        assert not turn.extension_errors and len(turn.extension_results) == 1
        return turn.extension_results[0]  # expanded with the SDK's worker, then handed off

    late = asyncio.run(after_revocation())
    assert sorted(r.state for r in late) == ["complete", "suppressed"]  # sub-a gets it; sub-c is gone
    bodies.update({k: v for k, v in asyncio.run(sealed_bodies(queue, cipher)).items()
                   if k in {r.idempotency_key for r in late if r.state == "complete"}})

    daemon = procs.start_daemon(env, tmp_path / "d.log")
    try:
        assert procs.wait_until(lambda: settled(pg_engine), 60)
    finally:
        assert procs.stop(daemon) == 0

    seen = [a for a in procs.arrivals(log) if a["type"] in TYPES and a["path"] in ("/flaky/2/503/a", "/ok/b", "/ok/c")]
    assert seen and all(a["verified"] for a in seen), [a for a in seen if not a["verified"]]
    by_key = collections.defaultdict(list)
    for a in seen:
        by_key[a["key"]].append(a)
    sent = {k: v for k, v in bodies.items() if json.loads(v)["subscriber_id"] != "sub-c"}
    assert set(by_key) == set(sent)  # every handed-off body arrived, the revoked subscriber's never did
    for idempotency_key, body in sent.items():
        arrivals = by_key[idempotency_key]
        assert all(a["body"].encode() == body for a in arrivals)  # the SDK's exact bytes
        validate_notification_payload(json.loads(body))
        payload = json.loads(body)
        expected_path = {"sub-a": "/flaky/2/503/a", "sub-b": "/ok/b"}[payload["subscriber_id"]]
        assert {a["path"] for a in arrivals} == {expected_path}
        statuses = [a["status"] for a in arrivals]
        assert statuses == ([503, 503, 200] if payload["subscriber_id"] == "sub-a" else [200])
    types_a = {json.loads(sent[k])["notification_type"] for k in sent
               if json.loads(sent[k])["subscriber_id"] == "sub-a"}
    assert types_a == set(TYPES)
    # Buyer A's revisions never reach buyer B.
    assert all(json.loads(a["body"]).get("reporting_revision_id", "rev_buyer-b") == "rev_buyer-b"
               for a in seen if a["path"] == "/ok/b")

    with pg_engine.connect() as conn:
        trail = conn.execute(select(messages.c.idempotency_key, func.count(attempts.c.id))
                             .join(attempts, attempts.c.message_id == messages.c.id)
                             .where(messages.c.subscriber_id == "sub-a", messages.c.notification_type.in_(TYPES))
                             .group_by(messages.c.idempotency_key)).all()
        records = outbox.webhook_activity(conn, tenant_id="t1", principal_id="buyer-a", settings=SETTINGS)
    assert {k: n for k, n in trail} == {k: 3 for k in sent if json.loads(sent[k])["subscriber_id"] == "sub-a"}
    assert {(r["idempotency_key"], r["notification_id"]) for r in records if r["status"] == "success"} == {
        (k, json.loads(v)["notification_id"]) for k, v in sent.items() if json.loads(v)["subscriber_id"] == "sub-a"}


async def record_in_postgres(pool, *items) -> list:
    """Events written in one transaction of the SDK's PostgreSQL ledger store."""
    from adcp_reporting_storage import PgReportingLedgerStore

    store = PgReportingLedgerStore(pool=pool, notifications=True)
    events = [new_event(ACCOUNT, cause, START) for cause in items]
    async with pool.connection() as conn, conn.transaction():
        for event in events:
            await store._record_notification(conn, event)
    return events


def test_outboxd_run_drives_the_handoff_on_the_sdk_postgres_outbox(pg_engine, pg_url, sdk_queues, tmp_path, receiver,
                                                                   monkeypatch, capsys):
    from psycopg_pool import AsyncConnectionPool

    key, base, log, _ = receiver
    register(pg_engine, "dm-a", "buyer-a", f"{base}/ok/dm-a")
    register(pg_engine, "dm-b", "buyer-b", f"{base}/ok/dm-b", ("reporting.ledger_changed",))
    conninfo = libpq_url(pg_url)

    async def with_pool(work):
        async with AsyncConnectionPool(conninfo, min_size=1, max_size=2) as pool:
            return await work(pool)

    env = with_example_handoff(procs.daemon_env(pg_url, key, seller_agent_url=SETTINGS.seller_agent_url,
                                                encryption_key=KEY))
    daemon = procs.start_daemon(env, tmp_path / "d.log")
    try:
        assert procs.wait_until(lambda: {s.state for s in listed(pg_engine)} == {"active"}, 60)
        # Status changes wait in the SDK's status queue for its status projector (the
        # factory hands that queue off too); the ledger queue carries the other two types.
        ledger_causes = [c for c in causes("buyer-a") if not isinstance(c, StatusChanged)]
        events = asyncio.run(with_pool(lambda pool: record_in_postgres(pool, *ledger_causes,
                                                                       causes("buyer-b")[0])))
        assert procs.wait_until(lambda: message_count(pg_engine) == 3 and settled(pg_engine), 60), \
            (tmp_path / "d.log").read_text()[-3000:]
        # `outboxd reporting --json`, in this process (the SDK is imported here already).
        for name in ("OUTBOX_DATABASE_URL", "OUTBOX_REPORTING_HANDOFF", "OUTBOX_ENCRYPTION_KEY",
                     "REPORTING_TENANT_ID", "REPORTING_CIPHER_KEY"):
            monkeypatch.setenv(name, env[name])
        monkeypatch.syspath_prepend(str(EXAMPLES))
        capsys.readouterr()
        assert cli.main(["reporting", "--json"]) == 0
        shown = capsys.readouterr().out
    finally:
        assert procs.stop(daemon) == 0
    report = json.loads(shown)
    assert report["backlog"] == {"expansions": 0, "deliveries": 0, "quarantined": 0}
    assert report["messages"] == {"delivered": 3}
    seen = [a for a in procs.arrivals(log) if a["path"] in ("/ok/dm-a", "/ok/dm-b") and a["type"] in TYPES]
    assert all(a["verified"] for a in seen) and len(seen) == 3
    ids = {e.notification_id: e.consumer_namespace for e in events}
    for a in seen:
        payload = json.loads(a["body"])
        validate_notification_payload(payload)
        assert ids[payload["notification_id"]] == {"/ok/dm-a": "buyer-a", "/ok/dm-b": "buyer-b"}[a["path"]]
    assert {json.loads(a["body"])["notification_type"] for a in seen if a["path"] == "/ok/dm-a"} == {
        "reporting.ledger_changed", "reporting.delivery_ready"}


def test_an_always_failing_buyer_expires_at_the_horizon_without_delaying_another_tenant(pg_engine, pg_url, tmp_path,
                                                                                        receiver):
    key, base, log, jwks = receiver
    env = procs.daemon_env(pg_url, key, seller_agent_url=SETTINGS.seller_agent_url, encryption_key=KEY)
    with procs.receiver(tmp_path, jwks, name="down") as (down_port, _):
        register(pg_engine, "down", "buyer-a", f"http://127.0.0.1:{down_port}/ok/down", (LEDGER,), tenant="t1")
        register(pg_engine, "up", "buyer-a", f"{base}/ok/up", (LEDGER,), tenant="t2")
        daemon = procs.start_daemon(env, tmp_path / "proofs.log")
        try:
            assert procs.wait_until(lambda: settled(pg_engine), 60)
        finally:
            assert procs.stop(daemon) == 0
    # Tenant t1's buyer endpoint is gone now (connections refused); t2's answers.
    handed = {}
    for tenant, sid in (("t1", "down"), ("t2", "up")):
        registry = Registry()
        registry.add(sid, "buyer-a", (LEDGER,))
        clock = Clock()
        store = InMemoryReportingLedgerStore(clock=clock, notifications=True)
        worker = ReportingNotificationWorker(outbox=InMemoryReportingOutbox(store), subscriptions=registry,
                                             cipher=ReportingEnvelopeCipher(os.urandom(32)), clock=clock)
        handoff = ReportingHandoff(worker=worker, engine=pg_engine, tenant_id=tenant, settings=SETTINGS, clock=clock)

        async def hand_off() -> list:
            await record(store, causes("buyer-a")[0])
            return await handoff.run_once()

        (result,) = asyncio.run(hand_off())
        handed[tenant] = result.message_id
    # This test's short horizon: as if enqueued a day less 20 s ago, so it is retried (every
    # back-off that comes before the horizon is kept) until its horizon, 20 s away, ends it.
    with pg_engine.begin() as conn:
        conn.execute(update(messages).where(messages.c.id == handed["t1"])
                     .values(created_at=messages.c.created_at - 86_400 + 20))
    daemon = procs.start_daemon(env, tmp_path / "d.log")
    try:
        assert procs.wait_until(lambda: settled(pg_engine), 60)
    finally:
        assert procs.stop(daemon) == 0
    with pg_engine.connect() as conn:
        down, up = (conn.execute(select(messages).where(messages.c.id == handed[t])).one() for t in ("t1", "t2"))
    assert (down.state, down.dead_reason) == ("dead", "expired") and down.attempts >= 2
    assert (up.state, up.attempts) == ("delivered", 1)
    assert up.finished_at < down.finished_at - 2  # delivered while the other tenant's buyer kept failing
    assert [a["path"] for a in procs.arrivals(log) if a["key"] == up.idempotency_key] == ["/ok/up"]
