"""Principal scoping, the exact-body store the reporting hand-off uses, revocation, and the
SDK resolver over outboxd's subscribers, on PostgreSQL and SQLite (no daemon).

Oracles: the ``adcp`` SDK's own subscription type and payload validation.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st
from sqlalchemy import select

import outbox
from adcp.reporting.outbox import ReportingNotificationSubscription
from outbox.config import with_overrides
from outbox.events import SubscriberUnavailable, enqueue_subscriber_body
from outbox.reporting_subscriptions import OutboxSubscriptionResolver
from outbox.schema import messages
from outbox.sealing import plaintext
from tests.reporting_world import ACCOUNT, LEDGER, ledger_body, prove_all


@pytest.fixture
def cfg(settings):
    return with_overrides(settings, seller_agent_url="https://seller.example/adcp")


def register(engine, cfg, sid: str, principal: str | None, events=(LEDGER, "account.status_changed")) -> None:
    with engine.begin() as conn:
        outbox.register_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, principal_id=principal, settings=cfg,
                                   notification_config={"subscriber_id": sid, "url": f"http://127.0.0.1:9/{sid}",
                                                        "event_types": list(events)})


def store(engine, cfg, sid: str, principal: str, body: bytes) -> int:
    with engine.begin() as conn:
        return enqueue_subscriber_body(conn, tenant_id="t1", account_id=ACCOUNT, subscriber_id=sid,
                                       principal_id=principal, body=body, settings=cfg).id


def fired_to(engine, notification_type: str) -> list[str]:
    with engine.connect() as conn:
        return sorted(conn.execute(select(messages.c.subscriber_id)
                                   .where(messages.c.notification_type == notification_type)).scalars())


def test_principal_scoped_types_fan_out_within_the_principal(engine, cfg):
    register(engine, cfg, "a-1", "buyer-a")
    register(engine, cfg, "a-2", "buyer-a")
    register(engine, cfg, "b-1", "buyer-b")
    register(engine, cfg, "nobody", None)
    prove_all(engine)
    payload = {"change_kind": "revision_published", "reporting_revision_id": "rev_1", "finality": "snapshot"}
    with engine.begin() as conn:
        with pytest.raises(outbox.OutboxValidationError, match="principal_id"):
            outbox.enqueue_event(conn, tenant_id="t1", account_id=ACCOUNT, notification_type=LEDGER,
                                 payload=payload, settings=cfg)
        fired = outbox.enqueue_event(conn, tenant_id="t1", account_id=ACCOUNT, notification_type=LEDGER,
                                     payload=payload, principal_id="buyer-a", settings=cfg)
        outbox.enqueue_event(conn, tenant_id="t1", account_id=ACCOUNT, notification_type="account.status_changed",
                             payload={"account_id": ACCOUNT, "status": "active"}, settings=cfg)
    assert len(fired) == 2 and fired_to(engine, LEDGER) == ["a-1", "a-2"]
    assert fired_to(engine, "account.status_changed") == ["a-1", "a-2", "b-1", "nobody"]  # account-wide type


def test_the_same_body_stored_twice_is_one_message_with_its_exact_bytes(engine, cfg):
    register(engine, cfg, "a-1", "buyer-a")
    prove_all(engine)
    body = ledger_body("a-1")
    first = store(engine, cfg, "a-1", "buyer-a", body)
    assert store(engine, cfg, "a-1", "buyer-a", body) == first  # a hand-off repeated after a crash
    with engine.connect() as conn:
        (row,) = conn.execute(select(messages).where(messages.c.notification_type == LEDGER)).all()
    assert plaintext(row, cfg.sealing()) == body
    assert (row.principal_id, row.subscriber_id, row.notification_id, row.state) == ("buyer-a", "a-1", "evt_1",
                                                                                      "pending")
    with pytest.raises(outbox.IdempotencyConflictError):  # the key is bound to its first notification
        store(engine, cfg, "a-1", "buyer-a", ledger_body("a-1", json.loads(body)["idempotency_key"],
                                                         reporting_revision_id="rev_2"))


def test_a_body_reaches_only_a_live_subscriber_of_its_own_principal(engine, cfg):
    register(engine, cfg, "a-1", "buyer-a")
    register(engine, cfg, "status-only", "buyer-a", ("reporting.status_changed",))
    prove_all(engine)
    with pytest.raises(SubscriberUnavailable):
        store(engine, cfg, "a-1", "buyer-b", ledger_body("a-1"))  # another principal's registration
    with pytest.raises(SubscriberUnavailable):
        store(engine, cfg, "status-only", "buyer-a", ledger_body("status-only"))  # not subscribed to the type
    with pytest.raises(outbox.OutboxValidationError, match="another account or subscriber"):
        store(engine, cfg, "a-1", "buyer-a", ledger_body("status-only"))
    with engine.begin() as conn:
        outbox.remove_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, subscriber_id="a-1")
    with pytest.raises(SubscriberUnavailable):
        store(engine, cfg, "a-1", "buyer-a", ledger_body("a-1"))
    assert fired_to(engine, LEDGER) == []


@pytest.mark.parametrize("revoke", ["remove", "pause"])
def test_revoking_a_subscriber_cancels_its_unsent_messages(engine, cfg, revoke):
    register(engine, cfg, "a-1", "buyer-a")
    register(engine, cfg, "a-2", "buyer-a")
    prove_all(engine)
    store(engine, cfg, "a-1", "buyer-a", ledger_body("a-1"))
    kept = store(engine, cfg, "a-2", "buyer-a", ledger_body("a-2"))
    with engine.begin() as conn:
        if revoke == "remove":
            assert outbox.remove_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, subscriber_id="a-1")
        else:
            outbox.register_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, principal_id="buyer-a", settings=cfg,
                                       notification_config={"subscriber_id": "a-1", "url": "http://127.0.0.1:9/a-1",
                                                            "event_types": [LEDGER, "account.status_changed"],
                                                            "active": False})
    with engine.connect() as conn:
        found = {r.subscriber_id: (r.id, r.state, r.dead_reason, r.last_error)
                 for r in conn.execute(select(messages).where(messages.c.notification_type == LEDGER))}
    assert found["a-1"][1:] == ("dead", "cancelled",
                                {"remove": "subscriber removed", "pause": "subscriber paused"}[revoke])
    assert found["a-2"] == (kept, "pending", None, None)


def test_a_cancelled_message_is_never_replayed(engine, cfg):
    from outbox.db import make_async_engine
    from supervisor.operator.replay import replay

    register(engine, cfg, "a-1", "buyer-a")
    prove_all(engine)
    message_id = store(engine, cfg, "a-1", "buyer-a", ledger_body("a-1"))
    with engine.begin() as conn:
        outbox.remove_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, subscriber_id="a-1")

    async def replayed() -> tuple:
        async_engine = make_async_engine(engine.url)
        try:
            result = await replay(async_engine, ids=[message_id], horizon_seconds=86_400, force=True)
        finally:
            await async_engine.dispose()
        return result.replayed, [r["why"] for r in result.refused]

    assert asyncio.run(replayed()) == ([], ["it was cancelled (its subscriber removed, or a cancel job)"])
    with engine.connect() as conn:
        assert conn.execute(select(messages.c.dead_reason).where(messages.c.id == message_id)).scalar() == "cancelled"


def _sealed_under_another_key(engine, cfg):
    """One delivery the SDK sealed with one cipher key, and a hand-off whose worker has
    another: (the queue, an async function expanding the event and returning the hand-off)."""
    from datetime import datetime, timezone

    from adcp.reporting.ledger import InMemoryReportingLedgerStore
    from adcp.reporting.ledger.notification_models import RevisionPublished, new_event
    from adcp.reporting.outbox import InMemoryReportingOutbox, ReportingEnvelopeCipher, ReportingNotificationWorker
    from outbox.reporting import ReportingHandoff

    register(engine, cfg, "a-1", "buyer-a")
    prove_all(engine)
    now = datetime(2026, 12, 1, 10, tzinfo=timezone.utc)
    ledger = InMemoryReportingLedgerStore(clock=lambda: now, notifications=True)
    queue = InMemoryReportingOutbox(ledger)
    resolver = OutboxSubscriptionResolver(engine, "t1", cfg)
    sealing, other_key = (ReportingNotificationWorker(outbox=queue, subscriptions=resolver, clock=lambda: now,
                                                      cipher=ReportingEnvelopeCipher(key)) for key in (b"k" * 32,
                                                                                                        b"x" * 32))

    async def expanded() -> ReportingHandoff:
        async with ledger._mutation():
            ledger._record_notification(new_event(ACCOUNT, RevisionPublished("rev_1", "buyer-a", "snapshot"), now))
        assert await sealing.expand_one(account_id=ACCOUNT)
        return ReportingHandoff(worker=other_key, engine=engine, tenant_id="t1", settings=cfg, clock=lambda: now)

    return queue, expanded


def test_a_delivery_that_does_not_open_is_quarantined_and_nothing_is_stored(engine, cfg):
    queue, expanded = _sealed_under_another_key(engine, cfg)

    async def run() -> list:
        return await (await expanded()).run_once()

    (result,) = asyncio.run(run())
    assert (result.state, result.message_id, result.finished) == ("quarantined", None, True)
    (status,) = asyncio.run(queue.list_deliveries(account_id=ACCOUNT))
    assert (status.state, status.error_code) == ("quarantined", "integrity_failure")
    assert fired_to(engine, LEDGER) == []


def test_the_daemons_turn_logs_each_quarantined_delivery_by_name(engine, cfg):
    """A delivery sealed under another daemon's cipher key is lost for good: the daemon says
    which, with the fix, where a per-process count (reset by every restart) was the only trace."""
    import structlog

    from supervisor.cycle.reporting_handoff import handoff_turn
    from supervisor.observe.metrics import Metrics

    queue, expanded = _sealed_under_another_key(engine, cfg)

    async def run() -> None:
        await handoff_turn((await expanded(),), Metrics())

    with structlog.testing.capture_logs() as logs:
        asyncio.run(run())
    (status,) = asyncio.run(queue.list_deliveries(account_id=ACCOUNT))
    [line] = [e for e in logs if e["event"] == "reporting.quarantined"]
    assert (line["delivery_id"], line["error"], line["tenant_id"]) == (status.delivery.binding.delivery_id,
                                                                       "integrity_failure", "t1")
    assert "cipher key" in line["hint"]


def test_the_sdk_resolver_sees_proven_subscribers_of_a_principal_only(engine, cfg):
    register(engine, cfg, "a-1", "buyer-a")
    register(engine, cfg, "nobody", None)
    resolver = OutboxSubscriptionResolver(engine, "t1", cfg)
    assert asyncio.run(resolver.list_active(account_id=ACCOUNT, notification_type=LEDGER)) == ()  # not proven yet
    prove_all(engine)
    (found,) = asyncio.run(resolver.list_active(account_id=ACCOUNT, notification_type=LEDGER))
    assert type(found) is ReportingNotificationSubscription
    assert (found.subscriber_id, found.principal_id, found.signing_scope_id) == ("a-1", "buyer-a", "t1")
    assert found.event_types == (LEDGER,)  # the SDK's subscription carries the reporting types only
    again = asyncio.run(resolver.get_active(account_id=ACCOUNT, subscriber_id="a-1", notification_type=LEDGER))
    assert again.fingerprint == found.fingerprint
    with engine.begin() as conn:
        outbox.remove_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, subscriber_id="a-1")
    assert asyncio.run(resolver.get_active(account_id=ACCOUNT, subscriber_id="a-1", notification_type=LEDGER)) is None


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.one_of(st.binary(max_size=200),
                     st.dictionaries(st.text(max_size=12), st.one_of(st.text(max_size=20), st.integers(), st.none()),
                                     max_size=4)  # a valid body with extra fields of any kind
                     .map(lambda extra: json.dumps({**extra, **json.loads(ledger_body("a-1"))}).encode()),
                     st.dictionaries(st.sampled_from(["idempotency_key", "notification_type", "account_id",
                                                      "subscriber_id", "notification_id"]),
                                     st.one_of(st.text(max_size=40), st.integers(), st.none()))
                     .map(lambda d: json.dumps(d).encode())))
def test_any_outside_body_is_stored_exactly_or_refused_with_a_validation_error(sqlite_engine, cfg, raw):
    register(sqlite_engine, cfg, "a-1", "buyer-a")
    prove_all(sqlite_engine)
    try:
        message_id = store(sqlite_engine, cfg, "a-1", "buyer-a", raw)
    except outbox.OutboxValidationError:
        return
    with sqlite_engine.connect() as conn:
        row = conn.execute(select(messages).where(messages.c.id == message_id)).one()
    assert plaintext(row, cfg.sealing()) == raw
