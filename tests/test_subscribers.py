"""Account-level subscribers and enqueue_event, on PostgreSQL and SQLite (no daemon).

Oracles: the AdCP 3.2 JSON schemas the ``adcp`` package ships (challenge bodies, fires,
credential-free state readback).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from sqlalchemy import select

import outbox
from outbox.activity import activity_url
from outbox.config import with_overrides
from outbox.identity import binding_digest
from outbox.schema import attempts, db_now, messages, subscribers
from outbox.sealing import plaintext
from outbox.subscribers import HOLD_UNTIL
from tests.adcp_schema import assert_valid

ACCOUNT = "acct_1"
STATUS_EVENT = {"account_id": ACCOUNT, "previous_status": "pending_approval", "status": "active",
                "observed_at": "2026-12-01T10:00:00Z", "reason_code": "seller_approved"}


@pytest.fixture
def cfg(settings):
    return with_overrides(settings, seller_agent_url="https://seller.example/adcp")


def config(sid: str, url: str = "http://127.0.0.1:9/hook", events=("account.status_changed",), **extra):
    return {"subscriber_id": sid, "url": url, "event_types": list(events), **extra}


def register(engine, cfg, entry, principal_id=None):
    with engine.begin() as conn:
        return outbox.register_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, notification_config=entry,
                                          principal_id=principal_id, settings=cfg)


def rows(engine, cfg, *where):
    """Message rows with their bodies opened (the settings seal them), as the daemon reads them."""
    with engine.connect() as conn:
        found = conn.execute(select(messages).where(*where).order_by(messages.c.id)).all()
    opened = [{**r._mapping, "body": plaintext(r, cfg.sealing())} for r in found]
    return [SimpleNamespace(**m, _mapping=m) for m in opened]


def test_a_new_subscriber_is_proven_before_it_is_active(engine, cfg):
    record = register(engine, cfg, config("buyer-primary"))
    assert record.state == "pending_proof" and record.active
    (challenge,) = rows(engine, cfg)
    assert challenge.notification_type == "webhook.challenge" and challenge.auth_mode == "rfc9421"
    assert challenge.subscriber_ref is not None and challenge.url == "http://127.0.0.1:9/hook"
    assert_valid(challenge.body, "core/webhook-challenge.json")
    body = json.loads(challenge.body)
    assert body["seller_agent_url"] == "https://seller.example/adcp" and body["delivery_auth"] == {"mode": "rfc9421"}
    assert record.challenge_message_id == challenge.id


def test_legacy_auth_is_announced_but_the_challenge_is_still_rfc9421(engine, cfg):
    secret = "s" * 40
    register(engine, cfg, config("legacy", authentication={"schemes": ["Bearer"], "credentials": secret}))
    (challenge,) = rows(engine, cfg)
    assert challenge.auth_mode == "rfc9421" and challenge.auth_secret is None
    auth = json.loads(challenge.body)["delivery_auth"]
    assert auth["mode"] == "Bearer" and len(auth["credential_fingerprint"]) == 64
    assert_valid(challenge.body, "core/webhook-challenge.json")
    with engine.connect() as conn:
        (state,) = outbox.list_subscribers(conn, tenant_id="t1")
    assert state.config_state() == {"subscriber_id": "legacy", "url": "http://127.0.0.1:9/hook",
                                    "event_types": ["account.status_changed"], "active": True,
                                    "authentication": {"schemes": ["Bearer"]}}
    assert secret not in repr(state)
    assert_valid(json.dumps(state.config_state()).encode(), "core/agent-notification-config-state.json")


def test_unchanged_resend_changes_nothing_and_a_change_needs_a_fresh_proof(engine, cfg):
    first = register(engine, cfg, config("s1"))
    assert register(engine, cfg, config("s1")) == first
    assert len(rows(engine, cfg)) == 1
    moved = register(engine, cfg, config("s1", url="http://127.0.0.1:9/other"))
    assert moved.state == "pending_proof" and moved.challenge_message_id != first.challenge_message_id
    old, new = rows(engine, cfg)
    assert (old.state, old.dead_reason) == ("dead", "proof_failed")  # the superseded proof is never sent
    assert new.state == "pending" and new.url.endswith("/other")
    widened = register(engine, cfg, config("s1", url="http://127.0.0.1:9/other",
                                           events=("account.status_changed", "creative.purged")))
    assert widened.challenge_message_id not in (first.challenge_message_id, moved.challenge_message_id)


def test_a_proof_that_ended_unsettled_is_made_again_when_the_same_entry_is_re_sent(engine, cfg):
    """A database an older release left with a subscriber waiting on a challenge that is
    already dead: re-sending the unchanged entry queues a new proof, and the fire held
    meanwhile stays held for it (never ended, never sent unproven)."""
    first = register(engine, cfg, config("stuck"))
    with engine.begin() as conn:
        (fire,) = outbox.enqueue_event(conn, tenant_id="t1", account_id=ACCOUNT,
                                       notification_type="account.status_changed", payload=STATUS_EVENT, settings=cfg)
        conn.execute(messages.update().where(messages.c.id == first.challenge_message_id)
                     .values(state="dead", dead_reason="expired", finished_at=db_now()))
    again = register(engine, cfg, config("stuck"))
    assert again.state == "pending_proof" and again.challenge_message_id != first.challenge_message_id
    new = rows(engine, cfg, messages.c.id == again.challenge_message_id)[0]
    assert new.state == "pending" and new.notification_type == "webhook.challenge"
    (held,) = rows(engine, cfg, messages.c.id == fire.id)
    assert held.held and held.state == "pending"
    assert register(engine, cfg, config("stuck")) == again, "a proof under way is not restarted"


def test_paused_subscribers_are_stored_not_proven_and_never_fired_to(engine, cfg):
    paused = register(engine, cfg, config("quiet", active=False))
    assert paused.state == "paused" and not paused.active
    assert rows(engine, cfg) == []
    with engine.begin() as conn:
        assert outbox.enqueue_event(conn, tenant_id="t1", account_id=ACCOUNT,
                                    notification_type="account.status_changed", payload=STATUS_EVENT,
                                    settings=cfg) == []
    with engine.connect() as conn:
        assert [s.state for s in outbox.list_subscribers(conn, tenant_id="t1", account_id=ACCOUNT)] == ["paused"]


def test_fan_out_matches_event_types_and_shares_one_notification_id(engine, cfg):
    register(engine, cfg, config("a"))
    register(engine, cfg, config("b", events=("account.status_changed", "creative.purged")))
    register(engine, cfg, config("c", events=("creative.purged",)))
    with engine.begin() as conn:
        fired = outbox.enqueue_event(conn, tenant_id="t1", account_id=ACCOUNT,
                                     notification_type="account.status_changed", payload=STATUS_EVENT, settings=cfg)
    assert len(fired) == 2 and len({f.idempotency_key for f in fired}) == 2
    fires = rows(engine, cfg, messages.c.notification_type == "account.status_changed")
    bodies = [json.loads(f.body) for f in fires]
    assert [b["subscriber_id"] for b in bodies] == ["a", "b"]
    assert len({b["notification_id"] for b in bodies}) == 1
    for fire in fires:
        assert_valid(fire.body, "core/account-status-changed-webhook.json")
        assert fire.held and fire.next_attempt_at == HOLD_UNTIL  # their proofs are still pending
        assert bytes(fire.binding_digest) == binding_digest(
            fire._mapping, cfg.sealing())  # docs/protocol.md "Idempotency"
    (challenge, *_) = rows(engine, cfg, messages.c.notification_type == "webhook.challenge")
    assert bytes(challenge.binding_digest) == binding_digest(challenge._mapping, cfg.sealing())


def test_validation_names_the_field(engine, cfg):
    cases = [
        (config("x", events=("scheduled",)), "notification_config.event_types[0]"),
        (config("x", events=()), "notification_config.event_types"),
        (config("bad id"), "notification_config.subscriber_id"),
        ({**config("x"), "token": "t" * 20}, "notification_config.token"),
        (config("x", url="http://10.0.0.1/hook"), "url"),
        (config("x", authentication={"schemes": ["Bearer"], "credentials": "short"}),
         "notification_config.authentication.credentials"),
        (config("x", active="yes"), "notification_config.active"),
    ]
    for entry, field in cases:
        with pytest.raises(outbox.OutboxValidationError) as error, engine.begin() as conn:
            outbox.register_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, notification_config=entry,
                                       settings=cfg)
        assert error.value.field == field
    with pytest.raises(outbox.OutboxValidationError) as error, engine.begin() as conn:
        outbox.enqueue_event(conn, tenant_id="t1", account_id=ACCOUNT, notification_type="account.status_changed",
                             payload={**STATUS_EVENT, "subscriber_id": "x"}, settings=cfg)
    assert error.value.field == "payload.subscriber_id"
    assert rows(engine, cfg) == []


def test_a_challenge_needs_the_seller_agent_url(engine, settings):
    with pytest.raises(outbox.ConfigurationError, match="OUTBOX_SELLER_AGENT_URL"), engine.begin() as conn:
        outbox.register_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, notification_config=config("x"),
                                   settings=settings)


def test_removing_a_subscriber_ends_its_held_fires(engine, cfg):
    register(engine, cfg, config("gone"))
    with engine.begin() as conn:
        outbox.enqueue_event(conn, tenant_id="t1", account_id=ACCOUNT, notification_type="account.status_changed",
                             payload=STATUS_EVENT, settings=cfg)
        assert outbox.remove_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, subscriber_id="gone")
        assert not outbox.remove_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, subscriber_id="gone")
    assert {(r.state, r.dead_reason) for r in rows(engine, cfg)} == {("dead", "proof_failed")}
    with engine.connect() as conn:
        assert conn.execute(select(subscribers)).all() == []


async def test_async_flavour_runs_in_the_callers_transaction(sqlite_url, cfg):
    from outbox.aio import enqueue_event, list_subscribers, register_subscriber
    from outbox.db import make_async_engine

    engine = make_async_engine(sqlite_url)
    try:
        async with engine.connect() as conn:
            await register_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, notification_config=config("a"),
                                      settings=cfg)
            fired = await enqueue_event(conn, tenant_id="t1", account_id=ACCOUNT,
                                        notification_type="account.status_changed", payload=STATUS_EVENT,
                                        settings=cfg)
            assert len(fired) == 1
            await conn.rollback()  # never committed by us: the rollback leaves nothing
            assert await list_subscribers(conn, tenant_id="t1") == []
    finally:
        await engine.dispose()


@pytest.mark.parametrize("url, shown", [
    ("https://b.example/hooks/adcp?token=abc#f", "https://b.example/hooks/adcp"),
    ("https://b.example/h/550e8400-e29b-41d4-a716-446655440000/x", "https://b.example/h/redacted/x"),
    ("https://b.example/h/sk_live_9aZ3kQ7xP2mW8vR4/in", "https://b.example/h/redacted/in"),
    ("https://b.example/webhooks/buyer-primary/v1", "https://b.example/webhooks/buyer-primary/v1"),
    ("https://user:pw@b.example/hooks/adcp", "https://b.example/hooks/adcp"),
])
def test_activity_urls_hide_queries_and_secret_looking_segments(url, shown):
    assert activity_url(url) == shown


def test_reactivating_a_proven_config_needs_no_new_proof(engine, cfg):
    first = register(engine, cfg, config("s1"))
    with engine.begin() as conn:  # as the daemon's completer records a proof that succeeded
        conn.execute(subscribers.update().values(state="active", proven_sha256=subscribers.c.config_sha256))
    assert register(engine, cfg, config("s1", active=False)).state == "paused"
    back = register(engine, cfg, config("s1"))
    assert back.state == "active" and back.challenge_message_id == first.challenge_message_id


def run_cli(capsys, monkeypatch, url, *args):
    from supervisor.cli import main

    monkeypatch.setenv("OUTBOX_DATABASE_URL", url)
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_shows_subscribers_their_proof_and_held_fires(engine, cfg, capsys, monkeypatch):
    url = engine.url.render_as_string(hide_password=False)
    register(engine, cfg, config("buyer-primary", url="http://127.0.0.1:9/hook?secret=1",
                                 authentication={"schemes": ["HMAC-SHA256"], "credentials": "h" * 40}))
    register(engine, cfg, config("audit", active=False))
    with engine.begin() as conn:
        outbox.enqueue_event(conn, tenant_id="t1", account_id=ACCOUNT, notification_type="account.status_changed",
                             payload=STATUS_EVENT, settings=cfg)
    code, out, _ = run_cli(capsys, monkeypatch, url, "subscribers", "list", "--json")
    listed = json.loads(out)
    assert code == 0 and [(r["subscriber_id"], r["state"], r["held_fires"]) for r in listed] == [
        ("audit", "paused", 0), ("buyer-primary", "pending_proof", 1)]
    assert all("?" not in r["url"] and "credentials" not in json.dumps(r) for r in listed)
    code, out, _ = run_cli(capsys, monkeypatch, url, "subscribers", "show", "buyer-primary", "--tenant", "t1",
                           "--account", ACCOUNT, "--json")
    shown = json.loads(out)
    assert shown["held_fires"] == 1 and shown["fires"] == {"pending": 1} and shown["proof"]["state"] == "pending"
    assert shown["authentication"] == {"schemes": ["HMAC-SHA256"]} and "h" * 40 not in out
    assert "SUBSCRIBER" in run_cli(capsys, monkeypatch, url, "subscribers", "list")[1]
    assert "proof" in run_cli(capsys, monkeypatch, url, "subscribers", "show", "buyer-primary", "--tenant", "t1",
                              "--account", ACCOUNT)[1]
    code, _, err = run_cli(capsys, monkeypatch, url, "subscribers", "show", "nobody", "--tenant", "t1",
                           "--account", ACCOUNT)
    assert code == 1 and err.count("\n") == 1
    code, out, _ = run_cli(capsys, monkeypatch, url, "status", "--json")
    assert json.loads(out)["subscribers"] == {"paused": 1, "pending_proof": 1}
    code, out, err = run_cli(capsys, monkeypatch, url, "list")
    assert code == 0, err
    assert "pending (held)" in out and "buyer-primary" in out
    code, out, _ = run_cli(capsys, monkeypatch, url, "show", str(shown["challenge_message_id"]), "--json")
    assert json.loads(out)["subscriber_state"] == "pending_proof"


def test_purge_keeps_attempts_inside_the_activity_retention(engine, cfg, capsys, monkeypatch):
    url = engine.url.render_as_string(hide_password=False)
    day = 86400.0
    with engine.begin() as conn:
        now = conn.execute(select(db_now())).scalar_one()
        for n, age_days in enumerate((29, 31)):
            key = outbox.enqueue(conn, tenant_id="t1", url="http://127.0.0.1:9/r", payload={"n": n},
                                 notification_type="impairment", settings=cfg).idempotency_key
            finished = now - age_days * day
            conn.execute(messages.update().where(messages.c.idempotency_key == key).values(
                state="delivered", attempts=1, finished_at=finished, retry_until=finished))
            message_id = conn.execute(select(messages.c.id).where(messages.c.idempotency_key == key)).scalar_one()
            conn.execute(attempts.insert().values(
                message_id=message_id, tenant_id="t1", url="http://127.0.0.1:9/r", attempt_number=1,
                outcome="success", http_status=200, will_retry=False, idempotency_key=key, trigger="scheduled",
                occurred_at=finished))
    code, out, err = run_cli(capsys, monkeypatch, url, "purge", "--older-than", "1d", "--json")
    assert code == 0 and json.loads(out)["deleted"] == 1  # only the 31-day-old one
    with engine.connect() as conn:
        assert conn.execute(select(attempts.c.occurred_at)).scalar_one() == pytest.approx(now - 29 * day)


def test_activity_lists_a_queued_fire_as_pending_for_its_principal_only(engine, cfg):
    with engine.begin() as conn:
        queued = outbox.enqueue(conn, tenant_id="t1", url="http://127.0.0.1:9/h/550e8400-e29b-41d4-a716-446655440000",
                                payload={"notification_id": "imp_1"}, notification_type="impairment",
                                principal_id="p1", media_buy_id="mb_1", settings=cfg)
        outbox.enqueue_task_webhook(conn, tenant_id="t1", task_id="task_1", task_type="create_media_buy",
                                    status="completed", principal_id="p1", settings=cfg,
                                    push_notification_config={"url": "http://127.0.0.1:9/t", "operation_id": "op"})
    with engine.connect() as conn:
        (record,) = outbox.webhook_activity(conn, tenant_id="t1", principal_id="p1", settings=cfg)
        assert outbox.webhook_activity(conn, tenant_id="t1", principal_id="p2", settings=cfg) == []
        assert outbox.webhook_activity(conn, tenant_id="t2", principal_id="p1", settings=cfg) == []
        assert outbox.webhook_activity(conn, tenant_id="t1", principal_id="p1", media_buy_id="mb_", settings=cfg) == []
        with pytest.raises(outbox.OutboxValidationError, match="limit"):
            outbox.webhook_activity(conn, tenant_id="t1", principal_id="p1", limit=201, settings=cfg)
    assert_valid(json.dumps(record).encode(), "core/webhook-activity-record.json")
    assert record["idempotency_key"] == queued.idempotency_key and record["notification_id"] == "imp_1"
    assert (record["attempt"], record["status"], record["completed_at"], record["http_status_code"]) == (
        1, "pending", None, None)
    assert record["url"] == "http://127.0.0.1:9/h/redacted"


def test_two_first_registrations_of_one_entry_at_once_agree(engine, cfg):
    """Neither sees the other's uncommitted row: the second waits for the first and finds it,
    as an unchanged re-send, instead of failing on the unique key."""
    import threading

    first = engine.connect()
    transaction = first.begin()
    outbox.register_subscriber(first, tenant_id="t1", account_id=ACCOUNT, notification_config=config("twin"),
                               settings=cfg)
    second: list = []
    racer = threading.Thread(target=lambda: second.append(_attempt(register, engine, cfg, config("twin"))))
    racer.start()
    racer.join(0.5)
    assert racer.is_alive(), "the second registration should wait for the first"
    transaction.commit()
    first.close()
    racer.join(10)
    [(record, error)] = second
    assert error is None and record.subscriber_id == "twin" and record.state == "pending_proof", error
    assert len([r for r in rows(engine, cfg) if r.notification_type == "webhook.challenge"]) == 1


def _attempt(call, *args):
    try:
        return call(*args), None
    except Exception as exc:  # the failure is the test's finding
        return None, exc


def test_no_replay_sends_a_fire_to_a_subscriber_removed_paused_or_moved(engine, cfg, capsys, monkeypatch):
    url = engine.url.render_as_string(hide_password=False)
    for sid in ("kept", "removed", "paused", "moved"):
        register(engine, cfg, config(sid, url=f"http://127.0.0.1:9/{sid}"))
    with engine.begin() as conn:  # as the daemon's completer records proofs that succeeded
        conn.execute(subscribers.update().values(state="active", proven_sha256=subscribers.c.config_sha256))
        outbox.enqueue_event(conn, tenant_id="t1", account_id=ACCOUNT, notification_type="account.status_changed",
                             payload=STATUS_EVENT, settings=cfg)
    fires = {json.loads(f.body)["subscriber_id"]: f.id
             for f in rows(engine, cfg, messages.c.notification_type == "account.status_changed")}
    with engine.begin() as conn:  # each fire ended before its subscriber changed: rejected, or delivered
        conn.execute(messages.update().where(messages.c.id.in_(list(fires.values())))
                     .values(state="dead", dead_reason="rejected", finished_at=db_now(), attempts=1))
        conn.execute(messages.update().where(messages.c.id == fires["paused"]).values(state="delivered",
                                                                                    dead_reason=None))
        assert outbox.remove_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, subscriber_id="removed")
    register(engine, cfg, config("paused", url="http://127.0.0.1:9/paused", active=False))
    with engine.begin() as conn:  # moved, and its new URL proven
        outbox.register_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, settings=cfg,
                                   notification_config=config("moved", url="http://127.0.0.1:9/elsewhere"))
        conn.execute(subscribers.update().where(subscribers.c.subscriber_id == "moved")
                     .values(state="active", proven_sha256=subscribers.c.config_sha256))
    code, out, err = run_cli(capsys, monkeypatch, url, "replay", *map(str, sorted(fires.values())), "--json")
    result = json.loads(out)
    assert code == 1 and result["replayed"] == [fires["kept"]], (out, err)
    assert {r["id"]: r["why"] for r in result["refused"]} == {
        fires[sid]: "its subscriber was removed, paused or moved to another URL" for sid in ("removed", "paused", "moved")}
    with engine.connect() as conn:
        states = dict(conn.execute(select(messages.c.id, messages.c.state)
                                   .where(messages.c.id.in_(list(fires.values())))).all())
    assert states == {fires["kept"]: "pending", fires["removed"]: "dead", fires["paused"]: "delivered",
                      fires["moved"]: "dead"}
