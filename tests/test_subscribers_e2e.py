"""End to end: account-level subscribers and webhook_activity against the real daemon.

One daemon run per database: four subscribers on one account (two that prove their URL,
one of them after a 503; one paused; one that never echoes), a re-pointed subscriber, and
delivery reports for two principals. The receiver verifies every signature with the
``adcp`` SDK's ``verify_webhook_signature``; bodies and activity records are checked
against the AdCP 3.2 schemas.
"""

from __future__ import annotations

import collections
import json

import pytest
from sqlalchemy import select

import outbox
from outbox.schema import attempts, messages, subscribers
from tests import procs
from tests.ledger import THROWAWAY_KEY, loopback_producer
from tests.adcp_schema import assert_valid

pytestmark = pytest.mark.e2e
ACCOUNT = "acct_glow"
PRINCIPAL = "buyer-1"
SETTINGS = loopback_producer(OUTBOX_SELLER_AGENT_URL="https://seller.example/adcp",
                             OUTBOX_ENCRYPTION_KEY=THROWAWAY_KEY)
REPORT = {"notification_type": "scheduled", "reporting_period": {"start": "2026-12-01T00:00:00Z",
                                                                  "end": "2026-12-01T01:00:00Z"},
          "currency": "USD", "media_buy_deliveries": []}


def status_event(n: int) -> dict:
    return {"account_id": ACCOUNT, "previous_status": "pending_approval", "status": "active",
            "observed_at": f"2026-12-01T10:00:0{n}Z", "reason_code": "seller_approved"}


def register(engine, sid: str, url: str, **extra) -> outbox.Subscriber:
    entry = {"subscriber_id": sid, "url": url, "event_types": ["account.status_changed"], **extra}
    with engine.begin() as conn:
        return outbox.register_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, notification_config=entry,
                                          principal_id=PRINCIPAL, settings=SETTINGS)


def fire(engine, n: int) -> list[outbox.EnqueuedMessage]:
    with engine.begin() as conn:
        return outbox.enqueue_event(conn, tenant_id="t1", account_id=ACCOUNT,
                                    notification_type="account.status_changed", payload=status_event(n),
                                    settings=SETTINGS)


def subscriber_states(engine) -> dict[str, str]:
    with engine.connect() as conn:
        return dict(conn.execute(select(subscribers.c.subscriber_id, subscribers.c.state)).all())


def settled(engine, keys) -> bool:
    with engine.connect() as conn:
        found = conn.execute(select(messages.c.state).where(messages.c.idempotency_key.in_(keys))).scalars().all()
    return len(found) == len(keys) and all(s in ("delivered", "dead") for s in found)


def activity(engine, **filters) -> list[dict]:
    with engine.connect() as conn:
        records = outbox.webhook_activity(conn, tenant_id="t1", settings=SETTINGS, **filters)
    for record in records:
        assert_valid(json.dumps(record).encode(), "core/webhook-activity-record.json")
    return records


@pytest.fixture(scope="module")
def verifying_receiver(tmp_path_factory):
    """One receiver for both databases (starting the SDK's verifier is the slow part)."""
    directory = tmp_path_factory.mktemp("receiver")
    key, jwks = procs.make_key(directory)
    with procs.receiver(directory, jwks, log_bodies=True) as (port, log):
        yield key, port, log


@pytest.mark.parametrize("db", ["postgresql", "sqlite"])
def test_subscribers_proofs_fires_and_activity(db, request, tmp_path, verifying_receiver):
    engine = request.getfixturevalue("pg_engine" if db == "postgresql" else "sqlite_engine")
    url = request.getfixturevalue("pg_url" if db == "postgresql" else "sqlite_url")
    key, port, log = verifying_receiver
    earlier = len(procs.arrivals(log))
    base = f"http://127.0.0.1:{port}"
    register(engine, "proving-a", f"{base}/ok/a")
    register(engine, "proving-b", f"{base}/flaky/1/503/b")  # first answer to each key (challenge too): 503
    register(engine, "paused", f"{base}/ok/paused", active=False)
    register(engine, "silent", f"{base}/noecho",  # legacy auth: its challenge is RFC 9421 all the same
             authentication={"schemes": ["Bearer"], "credentials": "b" * 40})
    first = fire(engine, 1)  # before any proof: held
    assert len(first) == 3
    with engine.begin() as conn:
        flaky_report = outbox.enqueue_delivery_report(
            conn, tenant_id="t1", reporting_webhook={"url": f"{base}/flaky/3", "operation_id": "op_1"},
            media_buy_id="mb_1", result=REPORT, principal_id=PRINCIPAL, settings=SETTINGS)
        outbox.enqueue_delivery_report(
            conn, tenant_id="t1", reporting_webhook={"url": f"{base}/ok/mb2", "operation_id": "op_2"},
            media_buy_id="mb_2", result=REPORT, principal_id=PRINCIPAL, settings=SETTINGS)
        other = outbox.enqueue_delivery_report(
            conn, tenant_id="t1", reporting_webhook={"url": f"{base}/ok/other", "operation_id": "op_3"},
            media_buy_id="mb_1", result=REPORT, principal_id="buyer-2", settings=SETTINGS)
    env = procs.daemon_env(url, key, proof_max_attempts=3, seller_agent_url=SETTINGS.seller_agent_url,
                           encryption_key=THROWAWAY_KEY)
    daemon = procs.start_daemon(env, tmp_path / "d.log")
    try:
        assert procs.wait_until(lambda: settled(engine, [m.idempotency_key for m in first]), 40), \
            subscriber_states(engine)
        assert subscriber_states(engine) == {"proving-a": "active", "proving-b": "active", "paused": "paused",
                                             "silent": "proof_failed"}
        second = fire(engine, 2)  # proven: sent at once; failed and paused: nothing
        assert len(second) == 2
        register(engine, "proving-a", f"{base}/ok/a-moved")  # re-pointed: proven anew
        third = fire(engine, 3)
        assert procs.wait_until(lambda: settled(engine, [m.idempotency_key for m in second + third]
                                                + [flaky_report.idempotency_key, other.idempotency_key]), 40)
    finally:
        assert procs.stop(daemon) == 0
    seen = procs.arrivals(log)[earlier:]
    assert seen and all(a["verified"] for a in seen), [a for a in seen if not a["verified"]]
    challenges = collections.Counter(a["path"] for a in seen if a["type"] == "webhook.challenge")
    assert challenges == {"/ok/a": 1, "/flaky/1/503/b": 2, "/noecho": 3, "/ok/a-moved": 1}
    for a in seen:
        if a["type"] == "webhook.challenge":
            assert_valid(a["body"].encode(), "core/webhook-challenge.json")
    reports = [a for a in seen if json.loads(a["body"]).get("task_type") == "media_buy_delivery"]
    assert len(reports) == 6  # 503-503-503-200 for mb_1, one each for mb_2 and buyer-2's report
    for a in reports:
        assert_valid(a["body"].encode())  # mcp-webhook-payload.json
        assert_valid(json.dumps(json.loads(a["body"])["result"]).encode(),
                     "media-buy/media-buy-delivery-webhook-result.json")
    fires = [a for a in seen if a["type"] == "account.status_changed"]
    for a in fires:
        assert_valid(a["body"].encode(), "core/account-status-changed-webhook.json")
    by_path = collections.defaultdict(list)
    for a in fires:
        if a["status"] == 200:  # /flaky/1 answers each fire's first arrival with a 503
            by_path[a["path"]].append(json.loads(a["body"])["observed_at"][-2:])
    # Event n carries observed_at ...0nZ: each subscriber got exactly its events, once each.
    assert {p: sorted(v) for p, v in by_path.items()} == {
        "/ok/a": ["1Z", "2Z"], "/flaky/1/503/b": ["1Z", "2Z", "3Z"], "/ok/a-moved": ["3Z"]}
    assert all(json.loads(a["body"])["subscriber_id"] != "silent" for a in fires)
    with engine.connect() as conn:
        silent_fire = conn.execute(select(messages).where(messages.c.subscriber_id == "silent",
                                                          messages.c.notification_type != "webhook.challenge")).one()
        proof_attempts = conn.execute(select(attempts.c.attempt_number, attempts.c.error)
                                      .join(messages, messages.c.id == attempts.c.message_id)
                                      .where(messages.c.subscriber_id == "silent",
                                             messages.c.notification_type == "webhook.challenge")
                                      .order_by(attempts.c.attempt_number)).all()
    assert (silent_fire.state, silent_fire.dead_reason, silent_fire.attempts) == ("dead", "proof_failed", 0)
    assert [n for n, _ in proof_attempts] == [1, 2, 3] and "URL proof failed" in proof_attempts[-1].error

    trail = activity(engine, principal_id=PRINCIPAL, media_buy_id="mb_1")
    assert [(r["attempt"], r["status"], r["http_status_code"]) for r in trail] == [
        (4, "success", 200), (3, "failed", 503), (2, "failed", 503), (1, "failed", 503)]
    assert {r["idempotency_key"] for r in trail} == {flaky_report.idempotency_key}
    assert [r["idempotency_key"] for r in activity(engine, principal_id="buyer-2")] == [other.idempotency_key]
    assert activity(engine, principal_id="buyer-3") == [] and activity(engine) == []
    account_log = activity(engine, principal_id=PRINCIPAL, account_id=ACCOUNT)
    assert {r["subscriber_id"] for r in account_log} == {"proving-a", "proving-b"}  # the silent fire was never sent
    assert all(r["notification_type"] == "account.status_changed" for r in account_log)
    assert len({r["notification_id"] for r in account_log}) == 3
    b_log = activity(engine, principal_id=PRINCIPAL, subscriber_id="proving-b")
    assert collections.Counter((r["attempt"], r["status"]) for r in b_log) == {(1, "failed"): 3, (2, "success"): 3}
