"""Every URL proof settles, whatever ends its challenge, and the same entry re-sent proves again.

End to end with the real daemon: a challenge whose horizon ends before its request can
start (claimed past it) fails its subscriber, its held fire ends dead ``proof_failed``, and
both show in ``/metrics`` and ``outboxd subscribers list``. Re-registering the same
configuration then proves the URL and releases what was held meanwhile.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
from sqlalchemy import select, text

import outbox
from outbox.schema import messages, subscribers
from tests import procs
from tests.ledger import THROWAWAY_KEY, loopback_producer

pytestmark = pytest.mark.e2e
ACCOUNT = "acct_late"
SETTINGS = loopback_producer(OUTBOX_SELLER_AGENT_URL="https://seller.example/adcp",
                             OUTBOX_ENCRYPTION_KEY=THROWAWAY_KEY)


def _register_and_fire(engine, url: str, n: int) -> tuple[outbox.Subscriber, int]:
    """The seller's transaction: the entry (re-)sent, and an event fired to it (held until proven)."""
    entry = {"subscriber_id": "late", "url": url, "event_types": ["account.status_changed"]}
    payload = {"account_id": ACCOUNT, "previous_status": "pending_approval", "status": "active",
               "observed_at": f"2026-12-01T10:00:0{n}Z", "reason_code": "seller_approved"}
    with engine.begin() as conn:
        subscriber = outbox.register_subscriber(conn, tenant_id="t1", account_id=ACCOUNT, notification_config=entry,
                                                settings=SETTINGS)
        (fired,) = outbox.enqueue_event(conn, tenant_id="t1", account_id=ACCOUNT,
                                        notification_type="account.status_changed", payload=payload,
                                        settings=SETTINGS)
    return subscriber, fired.id


def _row(engine, message_id: int):
    with engine.connect() as conn:
        return conn.execute(select(messages).where(messages.c.id == message_id)).one()


def _subscriber_state(engine) -> str:
    with engine.connect() as conn:
        return conn.execute(select(subscribers.c.state)).scalar_one()


def _metric(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name))


def test_a_challenge_past_its_horizon_fails_the_proof_visibly_and_a_resend_proves_again(
        pg_engine, pg_url, tmp_path) -> None:
    metrics_port = procs.free_port()
    key, jwks = procs.make_key(tmp_path)
    with procs.receiver(tmp_path, jwks) as (port, _):
        subscriber, held = _register_and_fire(pg_engine, f"http://127.0.0.1:{port}/ok/late", 1)
        with pg_engine.begin() as conn:  # its horizon is over by the time a daemon claims it
            conn.execute(text("UPDATE outbox_messages SET retry_until = extract(epoch from now()) - 1 WHERE id = :id"),
                         {"id": subscriber.challenge_message_id})
        env = procs.daemon_env(pg_url, key, metrics_addr=f"127.0.0.1:{metrics_port}",
                               seller_agent_url=SETTINGS.seller_agent_url, encryption_key=THROWAWAY_KEY)
        daemon = procs.start_daemon(env, tmp_path / "d.log")
        try:
            assert procs.wait_until(lambda: _subscriber_state(pg_engine) != "pending_proof", 60)
            assert _subscriber_state(pg_engine) == "proof_failed"
            challenge = _row(pg_engine, subscriber.challenge_message_id)
            assert (challenge.state, challenge.dead_reason, challenge.attempts) == ("dead", "expired", 0)
            fire = _row(pg_engine, held)
            assert (fire.state, fire.dead_reason, fire.held) == ("dead", "proof_failed", False)
            assert _metric(metrics_port, 'outbox_subscriber_proofs_total{outcome="failed"}') == 1
            assert _metric(metrics_port, 'outbox_held_fires_total{outcome="dead"}') == 1
            assert _metric(metrics_port, 'outbox_dead_letters_total{reason="proof_failed"}') == 1
            listed = subprocess.run([sys.executable, "-m", "supervisor.cli", "subscribers", "list", "--json"],
                                    env=env, capture_output=True, text=True, timeout=60)
            assert listed.returncode == 0, listed.stderr
            assert [(r["state"], r["held_fires"]) for r in json.loads(listed.stdout)] == [("proof_failed", 0)]

            again, waiting = _register_and_fire(pg_engine, f"http://127.0.0.1:{port}/ok/late", 2)  # the same entry
            assert again.state == "pending_proof" and again.challenge_message_id != subscriber.challenge_message_id
            assert procs.wait_until(lambda: _row(pg_engine, waiting).state == "delivered", 60)
            assert _subscriber_state(pg_engine) == "active"
            assert _metric(metrics_port, 'outbox_subscriber_proofs_total{outcome="proven"}') == 1
            assert _metric(metrics_port, 'outbox_held_fires_total{outcome="released"}') == 1
        finally:
            assert procs.stop(daemon) == 0
