"""Operator events: one per state change whoever notices it, delivered through the outbox
(signed, to a verifying receiver) and to callables, in JSON or Slack's format."""

from __future__ import annotations

import asyncio
import collections
import json

import pytest
from sqlalchemy import func, select

import outbox
from outbox.db import make_async_engine
from outbox.schema import breaker_transitions, messages, operator_events
from outbox.store import db_now
from supervisor.observe import events
from tests import procs
from tests.ledger import loopback_producer

RECEIVED: list[dict] = []


def remember(event: dict) -> None:
    """An operator event sink, named by dotted path in the tests."""
    RECEIVED.append(event)


async def broken(event: dict) -> None:
    raise RuntimeError("a sink that fails")


def _settings(**extra: str):
    return loopback_producer(OUTBOX_OPERATOR_EVENTS_URL="http://127.0.0.1:9/ops", **extra)


async def test_one_event_per_change_counted_per_window_and_published_once(engine):
    """The same change raised by two replicas is one row; deaths add up in their window's
    row, published when the window ends; two publishers at once enqueue each event once and
    hand it to the sinks once; a failing sink stops nothing; the operator tenant raises none."""
    url = engine.url.render_as_string(hide_password=False)
    first, second = make_async_engine(url), make_async_engine(url)
    RECEIVED.clear()
    try:
        async with first.connect() as conn:
            now = await db_now(conn)  # one time for both replicas: their deaths fall in the same window
        for replica in (first, second):
            async with replica.begin() as conn:
                trip = {"tenant_id": "acme", "origin": "https://b.example", "from_state": "closed",
                        "to_state": "open", "open_until": now + 30, "window_attempts": 10, "window_failures": 10,
                        "occurred_at": 1000.0}
                await events.breakers_moved(conn, [trip, {**trip, "tenant_id": events.OPERATOR_TENANT}])
                # a window that ends well after the test: not due; one that ended: due
                await events.messages_ended(conn, [("acme", "https://b.example", "gone")] * 2
                                            + [("acme", "https://b.example", "expired")], now=now + 600, window=300)
                await events.messages_ended(conn, [("acme", "https://b.example", "gone")], now=now - 900, window=300)
        sinks = events.load_sinks(["tests.test_operator_events:remember", "tests.test_operator_events:broken"])
        published = await asyncio.gather(events.publish_due(first, _settings(), sinks),
                                          events.publish_due(second, _settings(), sinks))
        again = await events.publish_due(first, _settings(), sinks)
        async with first.connect() as conn:
            rows = list(await conn.execute(select(operator_events).order_by(operator_events.c.id)))
            bodies = [json.loads(b) for b in (await conn.execute(select(messages.c.body).where(
                messages.c.tenant_id == events.OPERATOR_TENANT).order_by(messages.c.id))).scalars()]
    finally:
        await first.dispose()
        await second.dispose()
    summary = sorted((r.kind, r.count, r.published_at is not None) for r in rows)
    assert summary == [("breaker.opened", 1, True), ("messages.dead", 2, True), ("messages.dead", 4, False),
                       ("messages.expired", 2, False)]
    assert sum(published) == 2 and again == 0
    assert sorted(b["event"] for b in bodies) == ["breaker.opened", "messages.dead"]
    assert sorted(e["event"] for e in RECEIVED) == ["breaker.opened", "messages.dead"]
    opened = next(b for b in bodies if b["event"] == "breaker.opened")
    assert opened["tenant_id"] == "acme" and opened["origin"] == "https://b.example"
    assert opened["detail"]["from_state"] == "closed" and opened["idempotency_key"].startswith("whk_")


async def test_slack_format(pg_engine):
    async_engine = make_async_engine(pg_engine.url.render_as_string(hide_password=False))
    try:
        async with async_engine.begin() as conn:
            await events.messages_ended(conn, [("acme", "https://b.example", "gone")] * 3,
                                        now=await db_now(conn) - 900, window=300)
        await events.publish_due(async_engine, _settings(OUTBOX_OPERATOR_EVENTS_FORMAT="slack"), [])
        async with async_engine.connect() as conn:
            body = json.loads((await conn.execute(select(messages.c.body))).scalar_one())
    finally:
        await async_engine.dispose()
    assert set(body) == {"text", "idempotency_key"}
    assert body["text"] == "outboxd messages.dead acme@https://b.example ×3 (reason=gone)"


@pytest.mark.e2e
def test_a_dead_endpoint_raises_one_breaker_opened_per_trip_across_two_daemons(pg_engine, pg_url, tmp_path):
    """Two daemons share a dead endpoint's backlog; its breaker trips, half-opens, fails its
    probe and trips again. The operator receiver (verifying every signature) gets exactly
    one signed ``breaker.opened`` per trip, as many as the transition log holds."""
    key, jwks = procs.make_key(tmp_path)
    with procs.receiver(tmp_path, jwks) as (port, log), \
            procs.receiver(tmp_path, jwks, name="operator", log_bodies=True) as (op_port, op_log):
        with pg_engine.begin() as conn:
            for i in range(300):
                outbox.enqueue_task_webhook(
                    conn, tenant_id="sick", task_id=f"s{i}", task_type="create_media_buy", status="completed",
                    settings=_settings(), push_notification_config={"url": f"http://127.0.0.1:{port}/status/500",
                                                                    "operation_id": "op"})
        # A short open period keeps the test short: it is the number of events that is under test.
        env = procs.daemon_env(pg_url, key, operator_events_url=f"http://127.0.0.1:{op_port}/ok",
                               breaker_open_seconds="1", breaker_max_open_seconds="2")
        daemons = [procs.start_daemon(env, tmp_path / f"d{i}.log") for i in range(2)]

        def trips() -> int:
            with pg_engine.connect() as conn:
                return conn.execute(select(func.count()).select_from(breaker_transitions).where(
                    breaker_transitions.c.to_state == "open")).scalar()

        def opened() -> list[dict]:
            return [a for a in procs.arrivals(op_log) if json.loads(a["body"])["event"] == "breaker.opened"]
        try:
            assert procs.wait_until(lambda: len(opened()) >= 3, 120)
        finally:
            for d in daemons:
                assert procs.stop(d) == 0
    with pg_engine.connect() as conn:
        raised = conn.execute(select(operator_events.c.id).where(operator_events.c.kind == "breaker.opened")
                              ).scalars().all()
    arrivals = opened()
    per_event = collections.Counter(json.loads(a["body"])["id"] for a in arrivals)
    print(f"\n{trips()} trips, {len(raised)} breaker.opened events, {len(arrivals)} delivered")
    assert len(raised) == trips()  # one event per trip, whichever daemon recorded it
    assert set(per_event.values()) == {1} and set(per_event) <= set(raised)  # each delivered once
    assert all(a["status"] == 200 for a in arrivals)  # signed: the receiver verified every signature
    body = json.loads(arrivals[0]["body"])
    assert (body["tenant_id"], body["origin"]) == ("sick", f"http://127.0.0.1:{port}")


async def test_a_key_leaving_the_jwks_and_a_skewed_clock_are_each_told_once(engine):
    from outbox.schema import signing_keys

    async_engine = make_async_engine(engine.url.render_as_string(hide_password=False))
    RECEIVED.clear()
    try:
        async with async_engine.begin() as conn:
            now = await db_now(conn)
            for kid, unpublish in (("leaving-soon", now + 3600), ("leaving-later", now + 3 * 86400),
                                   ("gone-already", now - 60)):
                await conn.execute(signing_keys.insert().values(
                    kid=kid, scope="", alg="ed25519", key_file="/k.pem", public_jwk="{}", published_at=now - 86400,
                    unpublish_at=unpublish))
        for _ in range(2):  # two maintenance passes (or replicas)
            async with async_engine.begin() as conn:
                await events.keys_leaving(conn, await db_now(conn))
            await events.clock_skewed(async_engine, "the host clock is 90.0 s behind the database clock")
        await events.publish_due(async_engine, _settings(), events.load_sinks(["tests.test_operator_events:remember"]))
    finally:
        await async_engine.dispose()
    assert sorted(e["event"] for e in RECEIVED) == ["clock.skew", "key.unpublishing"]
    leaving = next(e for e in RECEIVED if e["event"] == "key.unpublishing")
    assert leaving["detail"]["kid"] == "leaving-soon" and leaving["detail"]["unpublish_at"].endswith("Z")
    skew = next(e for e in RECEIVED if e["event"] == "clock.skew")
    assert skew["count"] == 2 and "90.0 s" in skew["detail"]["problem"]


@pytest.mark.parametrize("url, problem", [("ftp://ops.example/x", "absolute https"),
                                          ("https://user:pw@ops.example/x", "userinfo"),
                                          ("https://10.0.0.5/x", "private")])
def test_an_operator_url_the_outbox_would_refuse_stops_the_start(url, problem):
    from outbox.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=f"OUTBOX_OPERATOR_EVENTS_URL .*{problem}"):
        outbox.load_settings(env={"OUTBOX_OPERATOR_EVENTS_URL": url})
