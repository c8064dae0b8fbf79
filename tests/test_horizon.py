"""The retry horizon is judged when each request starts, in the database's time.

A message leased in the second round of its origin (waiting in memory for a slot,
``supervisor/cycle/dispatch.py``) starts seconds after its claim; a ``Retry-After`` date arrives
seconds after it too. Both must be measured then, not at the claim.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import hashlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

import outbox
from outbox.db import make_async_engine
from outbox.leases import Claimed
from outbox.schema import attempts, messages
from supervisor.cycle.attempt import attempt
from supervisor.keys.keyring_cache import CachedKeyring
from supervisor.wire.transport import HttpSender
from tests import procs
from tests.ledger import PRODUCER, task_webhook

SLOW_MS = 8000  # each request takes this long: the second round waits for it (its lease allows 9 s)
LEFT_SECONDS = 4.0  # the horizon ends this long after enqueue (created_at moved back)


def _enqueue_near_horizon(engine, url: str, count: int) -> list[str]:
    """``count`` webhooks whose horizon (enqueue + horizon) ends ``LEFT_SECONDS`` from now."""
    with engine.begin() as conn:
        keys = [task_webhook(conn, f"task_{i}", f"{url}?n={i}").idempotency_key for i in range(count)]
        conn.execute(text("UPDATE outbox_messages SET created_at = extract(epoch from now()) + :left"
                          " - COALESCE(horizon_seconds, :horizon)"),
                     {"left": LEFT_SECONDS, "horizon": PRODUCER.retry_horizon_seconds})
    return keys


def test_a_message_waiting_for_a_slot_is_never_sent_past_its_horizon(pg_engine, pg_url, tmp_path: Path) -> None:
    """Default lease and read timeout with a 2 s connect timeout (a waiting message may start up
    to 17 s after its claim), two requests per origin (to keep the run short), a receiver that
    takes 8 s per request: the first round goes out at once, the second would start 8 s later,
    past the horizon."""
    key, jwks = procs.make_key(tmp_path)
    env = procs.daemon_env(pg_url, key, endpoint_concurrency=2, connect_timeout_seconds=2,
                           read_timeout_seconds=10, lease_seconds=30)
    log_file = tmp_path / "daemon.log"
    with procs.receiver(tmp_path, jwks) as (port, arrivals_log):
        daemon = procs.start_daemon(env, log_file)
        try:
            assert procs.wait_until(lambda: b"daemon.started" in log_file.read_bytes(), 60), log_file.read_text()
            keys = _enqueue_near_horizon(pg_engine, f"http://127.0.0.1:{port}/delay/{SLOW_MS}", 4)

            def finished() -> bool:
                with pg_engine.connect() as conn:
                    return conn.execute(select(messages.c.state).where(messages.c.state.in_(("pending", "in_flight")))
                                        ).first() is None

            assert procs.wait_until(finished, 90)
        finally:
            assert procs.stop(daemon) == 0
        arrived = procs.arrivals(arrivals_log)
    with pg_engine.connect() as conn:
        rows = {r.idempotency_key: r for r in conn.execute(select(messages))}
        attempt_rows = list(conn.execute(select(attempts)))
    for a in arrived:  # the receiver logs after its delay: it got the request SLOW_MS earlier, or sooner
        assert a["t"] - SLOW_MS / 1000 <= rows[a["key"]].retry_until, "a request reached the receiver past its horizon"
    sent = {a["key"] for a in arrived}
    outcomes = sorted((rows[k].state, rows[k].dead_reason) for k in keys)
    assert outcomes == [("dead", "expired")] * 2 + [("delivered", None)] * 2, outcomes
    for k in keys:
        assert (rows[k].state == "delivered") == (k in sent), "delivered exactly when the receiver got it"
    # An expired message was not sent: no attempt is recorded or counted for it.
    expired_ids = {rows[k].id for k in keys if rows[k].state == "dead"}
    assert not [r for r in attempt_rows if r.message_id in expired_ids]
    assert all(rows[k].attempts == 0 for k in keys if rows[k].state == "dead")


async def _answer_later(delay: float, retry_at: float, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:
    """A receiver that reads one request, waits ``delay`` seconds, and answers 503 with a
    ``Retry-After`` date of ``retry_at``."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    await reader.readexactly(length)
    await asyncio.sleep(delay)
    date = email.utils.formatdate(retry_at, usegmt=True)
    writer.write(f"HTTP/1.1 503 Service Unavailable\r\nRetry-After: {date}\r\nContent-Length: 0\r\n\r\n".encode())
    await writer.drain()
    writer.close()


def _claimed(url: str, *, claimed_ago: float) -> Claimed:
    """A leased message whose claim was sent ``claimed_ago`` seconds ago, the database's clock
    being the host's (as on SQLite)."""
    key = "whk_horizon_test_key_0000001"
    body = json.dumps({"idempotency_key": key, "task_id": "t"}).encode()
    now = time.time()
    return Claimed(id=1, tenant_id="t", url=url, origin=None, idempotency_key=key, body=body,
                   body_sha256=hashlib.sha256(body).digest(), auth_mode="rfc9421", auth_secret=None,
                   sequence_number=None, notification_type=None, attempt=1, retry_until=now + 3600,
                   created_at=now - 60, trigger="scheduled", claimed_at=now - claimed_ago, lease_token="x",
                   claim_sent=time.monotonic() - claimed_ago)


@asynccontextmanager
async def _attempts(tmp_path: Path, sqlite_url: str, handler) -> AsyncIterator[tuple[int, Any]]:
    """A receiver on 127.0.0.1 serving ``handler``, its port, and the daemon's attempt function
    (connect timeout 2 s, the keyring seeded on SQLite)."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    key, _ = procs.make_key(tmp_path)
    settings = outbox.load_settings(env=procs.daemon_env(sqlite_url, key))
    assert settings.connect_timeout_seconds == 2
    engine = make_async_engine(sqlite_url)
    keys = CachedKeyring(settings)
    sender = HttpSender(settings)
    try:
        await keys.start(engine)
        yield server.sockets[0].getsockname()[1], lambda m: attempt(m, settings=settings, keys=keys, sender=sender)
    finally:
        await sender.aclose()
        await engine.dispose()
        server.close()


async def test_a_retry_after_date_is_measured_from_the_answer_not_the_claim(tmp_path: Path, sqlite_url: str) -> None:
    """The message waited 6 s for its slot and the receiver took 1 s to answer 503 with a date
    30 s ahead: the retry waits until that date, not 7 s more."""
    retry_at = round(time.time()) + 30
    async with _attempts(tmp_path, sqlite_url, lambda r, w: _answer_later(1.0, retry_at, r, w)) as (port, send):
        outcome = await send(_claimed(f"http://127.0.0.1:{port}/hook", claimed_ago=6.0))
        answered_at = time.time()
    assert outcome.action == "retry" and outcome.http_status == 503, outcome
    assert outcome.retry_after == pytest.approx(retry_at - answered_at, abs=1.0), outcome.retry_after


@pytest.mark.parametrize("trigger", ["scheduled", "replay"])
async def test_a_message_whose_horizon_ends_before_its_request_starts_is_never_sent(
        tmp_path: Path, sqlite_url: str, trigger: str) -> None:
    """Claimed 1 s before its horizon ended, its request would start 1 s after (it waited for a
    slot): expired unsent, whether it is a first attempt or a replay; the receiver sees nothing.
    And one whose connect could end past the horizon (2 s allowed, 1.5 s left) does not start."""
    connections = []
    async with _attempts(tmp_path, sqlite_url, lambda r, w: connections.append(w)) as (port, send):
        waited = _claimed(f"http://127.0.0.1:{port}/hook", claimed_ago=2.0)
        close = _claimed(f"http://127.0.0.1:{port}/hook", claimed_ago=0.0)
        outcomes = [await send(dataclasses.replace(waited, retry_until=waited.claimed_at + 1.0, trigger=trigger)),
                    await send(dataclasses.replace(close, retry_until=close.claimed_at + 1.5, trigger=trigger))]
    assert [(o.action, o.reason, o.sent) for o in outcomes] == [("expire", "expired", False)] * 2
    assert connections == []
