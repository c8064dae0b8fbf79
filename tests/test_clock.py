"""Signature time is database time: measured offset, corrected signatures, refusal when too far.

The offset is measured against the real databases (PostgreSQL and SQLite) with an injected
host clock; the end-to-end tests give a real daemon a PostgreSQL whose ``now()`` runs ahead
(a function shadowing ``pg_catalog.now`` on the database's search_path) and read the
``created`` the receiver saw, or the line the daemon refuses to start with.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from adcp.signing import StaticJwksResolver
from adcp.signing.webhook_verifier import WebhookVerifyOptions, verify_webhook_signature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

import outbox
from outbox.db import make_async_engine, make_engine
from outbox.migrate import upgrade
from supervisor.cycle.clock import MAX_OFFSET_SECONDS, ClockOffsetError, DatabaseClock
from supervisor.cycle.outage import OutageGuard
from supervisor.wire.signing import ALG_ED25519, SigningKey, signature_headers
from tests import procs
from tests.ledger import PRODUCER

KEY = SigningKey("clock-key", ALG_ED25519, Ed25519PrivateKey.generate())
URL = "https://buyer.example/hooks"
BODY = b'{"idempotency_key":"whk_clock_00000001"}'
BEHIND = -30.0  # the end-to-end database clock's offset, within the daemon's tolerance


def _async_url(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


def _param(headers: dict[str, str], name: str) -> int:
    match = re.search(rf";{name}=(\d+);", headers["Signature-Input"])
    assert match is not None
    return int(match.group(1))


def _strict_receiver_accepts(headers: dict[str, str]) -> bool:
    """The SDK verifier, as a receiver that allows only 5 s of skew against the true time."""
    options = WebhookVerifyOptions(jwks_resolver=StaticJwksResolver({"keys": [KEY.public_jwk()]}),
                                   max_skew_seconds=5)
    try:
        verify_webhook_signature(method="POST", url=URL, headers=headers, body=BODY, options=options)
    except Exception:
        return False
    return True


@pytest.mark.parametrize("skew", [-45.0, 40.0])
async def test_signatures_carry_database_time_whatever_the_host_clock(engine: Engine, skew: float) -> None:
    host = lambda: time.time() + skew  # noqa: E731 - a host clock `skew` seconds off
    clock = DatabaseClock(host)
    async_engine = make_async_engine(_async_url(engine))
    try:
        offset = await clock.measure(async_engine)
    finally:
        await async_engine.dispose()
    assert abs(offset + skew) < 1.0 and clock.error < 1.0  # the database runs on true time here
    assert abs(clock() - time.time()) < 1.0
    corrected = signature_headers(KEY, url=URL, body=BODY, clock=clock)
    assert abs(_param(corrected, "created") - time.time()) <= 1.5
    assert _strict_receiver_accepts(corrected)
    uncorrected = signature_headers(KEY, url=URL, body=BODY, clock=host)
    if skew > 0:  # signed "in the future": a strict receiver refuses it
        assert not _strict_receiver_accepts(uncorrected)
    else:  # signed "in the past": it would expire that much early
        assert _param(uncorrected, "expires") - _param(corrected, "expires") == pytest.approx(skew, abs=1.5)


@pytest.mark.parametrize("step", [-7200.0, 600.0])
async def test_a_host_clock_step_after_the_measurement_does_not_move_signing_time(engine: Engine, step: float) -> None:
    """NTP stepping the host clock (a VM resumed, a late sync at boot) between two
    measurements: signatures keep database time, counted on the monotonic clock since the
    measurement, where they took the step for up to ten minutes and receivers rejected
    every one (webhook_signature_window_invalid, dead ``signature_rejected``)."""
    stepped = [0.0]
    clock = DatabaseClock(lambda: time.time() + stepped[0])
    async_engine = make_async_engine(_async_url(engine))
    try:
        await clock.measure(async_engine)
    finally:
        await async_engine.dispose()
    stepped[0] = step
    assert abs(clock() - time.time()) < 1.0
    assert _strict_receiver_accepts(signature_headers(KEY, url=URL, body=BODY, clock=clock))


@pytest.mark.parametrize("skew", [-(MAX_OFFSET_SECONDS + 30), MAX_OFFSET_SECONDS + 30])
async def test_offset_beyond_receiver_tolerance_is_refused(engine: Engine, skew: float) -> None:
    clock = DatabaseClock(lambda: time.time() + skew)
    async_engine = make_async_engine(_async_url(engine))
    try:
        with pytest.raises(ClockOffsetError) as caught:
            await clock.measure(async_engine)
    finally:
        await async_engine.dispose()
    message = str(caught.value)
    assert "\n" not in message and "NTP" in message
    assert ("ahead of" if skew > 0 else "behind") in message and f"{abs(skew):.0f}" in message
    assert clock.offset == 0.0  # nothing adopted


async def test_the_offset_is_measured_again_when_the_database_comes_back(engine: Engine) -> None:
    skew = [0.0]
    clock = DatabaseClock(lambda: time.time() + skew[0])
    outage = OutageGuard(deadline_seconds=60)
    async_engine = make_async_engine(_async_url(engine))
    watcher = asyncio.create_task(clock.watch(async_engine, outage))
    try:
        for skew[0] in (20.0, MAX_OFFSET_SECONDS + 40):  # the host clock steps while the database is away
            await outage.failed("test", ConnectionError("database restarting"))
            outage.ok("test")
            if skew[0] < MAX_OFFSET_SECONDS:
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    if abs(clock.offset + skew[0]) < 1.0:
                        break
                assert abs(clock.offset + skew[0]) < 1.0, "not re-measured after the outage"
        with pytest.raises(ClockOffsetError):
            await asyncio.wait_for(watcher, 30)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await async_engine.dispose()


# --------------------------------------------------------------------------- real daemon


@pytest.fixture
def skewed_pg(pg_server_url: str) -> Iterator[tuple[str, Callable[[float], None]]]:
    """A fresh migrated database whose ``now()`` can be set to run ``n`` seconds ahead."""
    name = f"outboxd_clock_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_url(pg_server_url).set(database=name).render_as_string(hide_password=False)

    def set_ahead(seconds: float) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE SCHEMA IF NOT EXISTS skew")
            conn.execute("CREATE OR REPLACE FUNCTION skew.now() RETURNS timestamptz LANGUAGE sql STABLE AS "
                         f"$$ SELECT pg_catalog.now() + interval '{float(seconds)} seconds' $$")
            conn.execute(f'ALTER DATABASE "{name}" SET search_path = skew, public, pg_catalog')

    upgrade(make_engine(url))
    yield url, set_ahead
    with psycopg.connect(pg_server_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.e2e
def test_daemon_signs_with_database_time_and_refuses_a_clock_too_far_off(skewed_pg, tmp_path: Path) -> None:
    url, set_ahead = skewed_pg
    set_ahead(BEHIND)  # within tolerance: the daemon runs, and signs 30 s "behind" this host
    pem, jwks = procs.make_key(tmp_path)
    engine = make_engine(url)
    # The RFC 9421 library verifier: it starts in a second where the SDK's import takes
    # tens of seconds on a loaded machine; the SDK verifies the same path in the tests above.
    with procs.receiver(tmp_path, jwks, verifier="library") as (port, log):
        with engine.begin() as conn:
            outbox.enqueue(conn, tenant_id="t", url=f"http://127.0.0.1:{port}/ok", settings=PRODUCER,
                           payload={"idempotency_key": "whk_clock_e2e_0001", "task_id": "task_1"})
            # The column default calls pg_catalog.now(), not the skewed one: make the message
            # due by the database time the daemon reads, as on a server with one clock.
            conn.execute(text("UPDATE outbox_messages SET next_attempt_at = next_attempt_at + :s"), {"s": BEHIND})
        daemon = procs.start_daemon(procs.daemon_env(url, pem), tmp_path / "daemon.log")
        try:
            assert procs.wait_until(lambda: procs.arrivals(log), 120), (tmp_path / "daemon.log").read_text()
        finally:
            assert procs.stop(daemon) == 0
        (arrival,) = procs.arrivals(log)
        created = _param({"Signature-Input": arrival["signature_input"]}, "created")
        assert abs(created - (arrival["t"] + BEHIND)) < 3, "signed with host time, not database time"
        assert arrival["verified"]
    engine.dispose()

    set_ahead(MAX_OFFSET_SECONDS + 60)
    run = subprocess.run([sys.executable, "-m", "supervisor.cli", "run"], env=procs.daemon_env(url, pem),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    (line,) = [ln for ln in run.stderr.splitlines() if ln.startswith("outboxd run:")]
    assert re.search(r"is 1[12]\d\.\d s behind the database clock", line), run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.e2e
def test_a_clock_found_too_far_off_while_delivering_stops_the_daemon_as_a_stop_does(skewed_pg, tmp_path: Path) -> None:
    """Requests in flight finish and are recorded before the daemon exits 1 with the clock's
    line: it dropped them, leaving their leases to expire and their messages to be sent again
    (and a request the buyer had answered 200 to be sent a second time)."""
    url, set_ahead = skewed_pg
    set_ahead(0)
    pem, jwks = procs.make_key(tmp_path)
    engine = make_engine(url)
    with procs.receiver(tmp_path, jwks, verifier="library") as (port, log):
        with engine.begin() as conn:
            for i in range(30):
                outbox.enqueue(conn, tenant_id="t", url=f"http://127.0.0.1:{port}/delay/1500", settings=PRODUCER,
                               payload={"idempotency_key": f"whk_clock_stop_{i:04d}", "task_id": f"task_{i}"})
        daemon = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run"],
                                  env=procs.daemon_env(url, pem, shutdown_grace_seconds=10),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            assert procs.wait_until(lambda: len(procs.arrivals(log)) >= 8, 60)
            set_ahead(-(MAX_OFFSET_SECONDS + 60))  # behind: a clock ahead would also expire every lease
            with psycopg.connect(url, autocommit=True) as conn:  # the clock is measured again after an outage
                conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                             "WHERE datname = current_database() AND pid <> pg_backend_pid()")
            _, stderr = daemon.communicate(timeout=90)
        finally:
            if daemon.poll() is None:
                daemon.kill()
    assert daemon.returncode == 1 and "ahead of the database clock" in stderr, stderr[-2000:]
    engine.dispose()  # its pooled connection was terminated with the daemon's
    with engine.connect() as conn:
        left = conn.execute(text("SELECT count(*) FROM outbox_messages WHERE state = 'in_flight'")).scalar_one()
        delivered = conn.execute(text("SELECT count(*) FROM outbox_messages WHERE state = 'delivered'")).scalar_one()
    engine.dispose()
    arrived = {a["key"] for a in procs.arrivals(log)}
    assert left == 0, f"{left} leases left to expire"
    with engine.connect() as conn:
        trail = conn.execute(text("SELECT m.state, a.outcome, m.last_error, count(*) FROM outbox_messages m "
                                  "LEFT JOIN outbox_attempts a ON a.message_id = m.id GROUP BY 1, 2, 3")).all()
    assert delivered == len(arrived), f"an answered request was not recorded: {trail}"
