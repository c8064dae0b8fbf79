"""End to end: a reporting subscription revoked while its notification is on the wire.

The daemon's request reaches a receiver that holds it open; the subscriber is removed (or
paused) meanwhile; the receiver then answers 503, which would be retried. The message must
end dead ``cancelled`` after that one attempt: a revoked subscription is sent nothing more.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from sqlalchemy import func, select

import outbox
from adcp.reporting.ledger import InMemoryReportingLedgerStore
from adcp.reporting.outbox import InMemoryReportingOutbox, ReportingEnvelopeCipher, ReportingNotificationWorker
from outbox.reporting import ReportingHandoff
from outbox.schema import attempts, messages
from tests import procs
from tests.reporting_world import ACCOUNT, KEY, LEDGER, SETTINGS, Clock, Registry, causes, listed, record, register

pytestmark = pytest.mark.e2e


class HeldReceiver(ThreadingHTTPServer):
    """Echoes URL challenges; holds each notification until the test releases it, then
    answers ``status``."""

    daemon_threads = True

    def __init__(self, status: int = 503) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.status = status
        self.arrived = threading.Event()
        self.release = threading.Event()
        self.notifications: list[str] = []


class _Handler(BaseHTTPRequestHandler):
    server: HeldReceiver

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("type") == "webhook.challenge":
            self._answer(200, json.dumps({"challenge": body["challenge"]}).encode())
            return
        self.server.notifications.append(body["idempotency_key"])
        self.server.arrived.set()
        self.server.release.wait(60)
        self._answer(self.server.status, b"")

    def _answer(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


def revoke(engine, how: str, url: str) -> None:
    with engine.begin() as conn:
        if how == "removed":
            assert outbox.remove_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, subscriber_id="held")
        else:
            outbox.register_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, principal_id="buyer-a",
                                       notification_config={"subscriber_id": "held", "url": url, "active": False,
                                                            "event_types": [LEDGER]}, settings=SETTINGS)


@pytest.mark.parametrize("how", ["removed", "paused"])
def test_a_subscription_revoked_during_its_request_is_not_retried(pg_engine, pg_url, tmp_path, how):
    server = HeldReceiver()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/reporting"
    key, _ = procs.make_key(tmp_path)
    # The receiver holds the request while the test revokes: a read timeout longer than that.
    env = procs.daemon_env(pg_url, key, seller_agent_url=SETTINGS.seller_agent_url,
                           encryption_key=KEY, read_timeout_seconds=20, lease_seconds=30)
    register(pg_engine, "held", "buyer-a", url, (LEDGER,))
    registry = Registry()
    registry.add("held", "buyer-a", (LEDGER,))
    clock = Clock()
    store = InMemoryReportingLedgerStore(clock=clock, notifications=True)
    worker = ReportingNotificationWorker(outbox=InMemoryReportingOutbox(store), subscriptions=registry,
                                         cipher=ReportingEnvelopeCipher(os.urandom(32)), clock=clock)
    handoff = ReportingHandoff(worker=worker, engine=pg_engine, tenant_id="t1", settings=SETTINGS, clock=clock)
    daemon = procs.start_daemon(env, tmp_path / "d.log")
    try:
        assert procs.wait_until(lambda: [s.state for s in listed(pg_engine)] == ["active"], 60)

        async def hand_off() -> list:
            await record(store, causes("buyer-a")[0])
            return await handoff.run_once()

        (result,) = asyncio.run(hand_off())
        assert server.arrived.wait(60), (tmp_path / "d.log").read_text()[-3000:]
        with pg_engine.connect() as conn:
            assert conn.execute(select(messages.c.state).where(messages.c.id == result.message_id)).scalar_one() \
                == "in_flight"
        revoke(pg_engine, how, url)
        server.release.set()

        def ended():
            with pg_engine.connect() as conn:
                return conn.execute(select(messages.c.state, messages.c.dead_reason)
                                    .where(messages.c.id == result.message_id)).one()
        assert procs.wait_until(lambda: ended().state == "dead", 60), ended()
    finally:
        assert procs.stop(daemon) == 0
        server.shutdown()
    assert ended().dead_reason == "cancelled"
    with pg_engine.connect() as conn:
        trail = conn.execute(select(attempts.c.http_status, attempts.c.will_retry)
                             .where(attempts.c.message_id == result.message_id)).all()
    assert [tuple(t) for t in trail] == [(503, False)]
    assert server.notifications == [result.idempotency_key]



@pytest.mark.parametrize("how", ["removed", "paused"])
def test_fires_leased_but_not_yet_sent_are_not_sent_after_a_revocation(pg_engine, pg_url, tmp_path, how):
    """The claim leases up to twice an origin's concurrency; the second round waits in the
    daemon's memory for a slot. Those fires are not on the wire when the subscriber is removed
    or paused: none of them may be sent after the revocation commits (they were, seconds later,
    once the requests ahead of them ended). The requests on the wire are answered 200, so
    no breaker hands the waiting fires back first."""
    server = HeldReceiver(200)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/events"
    key, _ = procs.make_key(tmp_path)
    # The default lease and timeouts: shortened ones hand a waiting fire back for want of lease.
    env = procs.default_daemon_env(pg_url, key, seller_agent_url=SETTINGS.seller_agent_url, encryption_key=KEY)
    register(pg_engine, "held", "buyer-a", url, ("account.status_changed",))
    daemon = procs.start_daemon(env, tmp_path / "d.log")
    try:
        assert procs.wait_until(lambda: [s.state for s in listed(pg_engine)] == ["active"], 60)
        with pg_engine.begin() as conn:
            for i in range(12):  # one origin, OUTBOX_ENDPOINT_CONCURRENCY 8: 8 on the wire, 4 waiting
                outbox.enqueue_event(conn, tenant_id="t1", account_id=ACCOUNT, settings=SETTINGS,
                                     notification_type="account.status_changed",
                                     payload={"account_id": ACCOUNT, "status": "active", "i": i})
        assert procs.wait_until(lambda: len(server.notifications) == 8, 60), (tmp_path / "d.log").read_text()[-3000:]

        def leased() -> int:
            with pg_engine.connect() as conn:
                return conn.execute(select(func.count()).where(messages.c.state == "in_flight")).scalar_one()
        assert procs.wait_until(lambda: leased() == 12, 30), leased()  # the 4 beyond the cap claimed ahead
        revoke(pg_engine, how, url)
        on_the_wire = list(server.notifications)
        server.release.set()

        def states() -> list[tuple[str, str | None]]:
            with pg_engine.connect() as conn:
                return [tuple(r) for r in conn.execute(select(messages.c.state, messages.c.dead_reason)
                                                       .where(messages.c.notification_type != "webhook.challenge"))]
        assert procs.wait_until(lambda: all(s in ("dead", "delivered") for s, _ in states()), 60), states()
    finally:
        assert procs.stop(daemon) == 0
        server.shutdown()
    assert sorted(states()) == [("dead", "cancelled")] * 4 + [("delivered", None)] * 8
    assert server.notifications == on_the_wire  # nothing more arrived after the revocation
    with pg_engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(attempts)
                            .where(attempts.c.notification_type != "webhook.challenge")).scalar_one() == 8


async def _two_flushes(url: str, settings) -> tuple[list[str], list[str]]:
    """Claim every due message, then record a 503 for each: the plain webhooks in one flush,
    the rest in another. The statements of each flush."""
    from sqlalchemy import event

    from outbox import store
    from outbox.db import make_async_engine
    from sinks.fanout import SinkFanout
    from supervisor.cycle.attempt import Outcome
    from supervisor.cycle.completer import Completer
    from supervisor.observe.metrics import Metrics
    from supervisor.cycle.outage import OutageGuard

    engine = make_async_engine(url)
    statements: list[str] = []
    try:
        async with engine.begin() as conn:
            claimed = await store.claim(conn, limit=50, lease_seconds=30, horizon_seconds=86_400, daemon_id="u",
                                        endpoint_concurrency=50)
        event.listen(engine.sync_engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
        completer = Completer(engine, settings=settings, daemon_id="u", metrics=Metrics(),
                              fanout=SinkFanout([], timeout=1), outage=OutageGuard(5))
        flushes = []
        for batch in ([m for m in claimed if m.subscriber_ref is None], [m for m in claimed if m.subscriber_ref]):
            statements.clear()
            await completer._flush_until_done([Outcome(m, "retry", "failed", http_status=503, sent=True)
                                               for m in batch])
            flushes.append(list(statements))
    finally:
        await engine.dispose()
    return flushes[0], flushes[1]


def test_the_revocation_check_costs_no_statement_without_subscriber_fires(pg_engine, pg_url, settings):
    from sqlalchemy import insert

    with pg_engine.begin() as conn:
        conn.execute(insert(messages), [{"tenant_id": "t1", "url": "https://buyer.example.com/h",
                                         "idempotency_key": f"plain_webhook_{i:04d}", "body": b"{}"}
                                        for i in range(20)])
        # A subscriber's fire whose subscriber row is gone (removed while it was in flight).
        conn.execute(insert(messages).values(tenant_id="t1", url="https://buyer.example.com/h", body=b"{}",
                                             idempotency_key="fire_of_a_removed_subscriber", subscriber_ref=987654))
    plain, fire = asyncio.run(_two_flushes(pg_url, settings))
    assert plain and not [s for s in plain if "outbox_subscribers" in s]
    assert len([s for s in fire if "outbox_subscribers" in s]) == 1
    with pg_engine.connect() as conn:
        rows = {r.idempotency_key: (r.state, r.dead_reason) for r in conn.execute(select(messages))}
    assert rows.pop("fire_of_a_removed_subscriber") == ("dead", "cancelled")
    assert set(rows.values()) == {("pending", None)}
