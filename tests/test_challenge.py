"""Judging webhook.challenge answers (outside input: property-tested) and settling proofs."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings as hsettings, strategies as st
from sqlalchemy import select

import outbox
from outbox import store
from outbox.config import with_overrides
from outbox.db import make_async_engine
from outbox.schema import messages, subscribers
from supervisor.cycle import challenge
from supervisor.wire.classify import Verdict

VALUE = "Zm9vYmFyYmF6cXV4Zm9vYmFyYmF6cXV4Zm9vYmFy"
BODY = json.dumps({"type": "webhook.challenge", "challenge": VALUE}).encode()
OK = Verdict("delivered", None, "success", None, "HTTP 200")


@pytest.mark.parametrize("answer, problem", [
    ({"challenge": VALUE}, None),
    ({"token": VALUE}, None),
    ({"challenge": VALUE, "token": VALUE}, "exactly one"),
    ({"challenge": VALUE[:-1] + "x"}, "not echoed"),
    ({"challenge": 42}, "exactly one"),
    ({}, "exactly one"),
])
def test_echo(answer, problem):
    found = challenge.echo_problem(BODY, json.dumps(answer).encode())
    assert found is None if problem is None else problem in found


@given(st.binary(max_size=300))
@hsettings(max_examples=200, deadline=None)
def test_any_answer_is_judged_without_raising_and_only_the_echo_proves(raw):
    proved = challenge.echo_problem(BODY, raw) is None
    assert not proved or VALUE.encode() in raw


def test_judge_turns_a_missing_echo_into_a_retry_then_a_failed_proof():
    retry = challenge.judge(OK, attempt=1, challenge_body=BODY, response_body=b"", max_attempts=3)
    assert (retry.action, retry.outcome) == ("retry", "failed") and "not a JSON object" in retry.detail
    last = challenge.judge(OK, attempt=3, challenge_body=BODY, response_body=b"{}", max_attempts=3)
    assert (last.action, last.reason) == ("dead", "proof_failed")
    gone = Verdict("dead", "gone", "failed", None, "HTTP 410")
    assert challenge.judge(gone, attempt=1, challenge_body=BODY, response_body=b"", max_attempts=3) == gone
    proven = challenge.judge(OK, attempt=1, challenge_body=BODY, response_body=json.dumps({"token": VALUE}).encode(),
                             max_attempts=3)
    assert proven == OK


async def test_a_proof_that_expires_fails_its_subscriber_and_held_fires(engine, settings):
    cfg = with_overrides(settings, seller_agent_url="https://seller.example/adcp")
    entry = {"subscriber_id": "s1", "url": "http://127.0.0.1:9/h", "event_types": ["creative.purged"]}
    with engine.begin() as conn:
        record = outbox.register_subscriber(conn, tenant_id="t1", account_id="a1", notification_config=entry,
                                            settings=cfg)
        (fire,) = outbox.enqueue_event(conn, tenant_id="t1", account_id="a1", notification_type="creative.purged",
                                       payload={"creative_id": "c1"}, settings=cfg)
        conn.execute(messages.update().where(messages.c.id == record.challenge_message_id)
                     .values(created_at=1.0, retry_until=2.0))  # enqueued long before its horizon
    async_engine = make_async_engine(engine.url)
    try:
        async with async_engine.begin() as conn:  # what the daemon's maintenance does
            expired = [r.id for r in await store.expire_past_horizon(conn, horizon_seconds=86_400)]
            await challenge.settle(conn, [], expired)
    finally:
        await async_engine.dispose()
    assert expired == [record.challenge_message_id]
    with engine.connect() as conn:
        assert conn.execute(select(subscribers.c.state)).scalar_one() == "proof_failed"
        held = conn.execute(select(messages).where(messages.c.id == fire.id)).one()
    assert (held.state, held.dead_reason, held.held) == ("dead", "proof_failed", False)


def test_a_fire_enqueued_while_its_proof_settles_is_never_left_held(pg_engine, pg_url, settings):
    """enqueue_event holds the subscriber row (FOR SHARE): a concurrent settle waits for it."""
    import asyncio
    import threading

    cfg = with_overrides(settings, seller_agent_url="https://seller.example/adcp")
    entry = {"subscriber_id": "s1", "url": "http://127.0.0.1:9/h", "event_types": ["creative.purged"]}
    with pg_engine.begin() as conn:
        record = outbox.register_subscriber(conn, tenant_id="t1", account_id="a1", notification_config=entry,
                                            settings=cfg)

    async def settle_proof() -> None:
        engine = make_async_engine(pg_url)
        try:
            async with engine.begin() as conn:
                await challenge.settle(conn, [record.challenge_message_id], [])
        finally:
            await engine.dispose()

    with pg_engine.connect() as seller:
        seller.begin()
        (fire,) = outbox.enqueue_event(seller, tenant_id="t1", account_id="a1", notification_type="creative.purged",
                                       payload={"creative_id": "c1"}, settings=cfg)
        daemon = threading.Thread(target=lambda: asyncio.run(settle_proof()))
        daemon.start()
        daemon.join(1.0)
        assert daemon.is_alive(), "the settle must wait for the seller's transaction"
        seller.commit()
    daemon.join(10)
    with pg_engine.connect() as conn:
        held = conn.execute(select(messages.c.held, messages.c.next_attempt_at).where(messages.c.id == fire.id)).one()
        assert conn.execute(select(subscribers.c.state)).scalar_one() == "active"
    assert not held.held and held.next_attempt_at < 1e12
