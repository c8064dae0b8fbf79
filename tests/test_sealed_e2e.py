"""Sealed bodies end to end: the real daemon, a receiver verifying with the adcp SDK."""

from __future__ import annotations

import base64
import hashlib
import os
import threading
import time
import urllib.request

import pytest
from sqlalchemy import select

import outbox
from outbox.schema import messages
from supervisor.cli import main as cli
from tests import procs, stored
from tests.ledger import finished, loopback_producer, states, task_webhook
from tests.procs import free_port

pytestmark = pytest.mark.e2e


def new_key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


def producer_settings(active: str) -> outbox.Settings:
    return loopback_producer(OUTBOX_ENCRYPTION_KEY=active)


def enqueue(engine, settings, base: str, path: str, i: int) -> int:
    with engine.begin() as conn:
        return task_webhook(conn, f"task_{i}", f"{base}{path}", tenant="sealed", settings=settings,
                            token=f"sealed-e2e-token-{i:06d}").id


def sent_bytes(engine, message_id: int, settings) -> str:
    return hashlib.sha256(stored.body(engine, message_id, settings)).hexdigest()


def test_retries_and_replay_send_the_exact_rendered_bytes(pg_engine, pg_url, tmp_path, monkeypatch, capsys):
    key, jwks = procs.make_key(tmp_path)
    secret = new_key()
    settings = producer_settings(secret)
    with procs.receiver(tmp_path, jwks) as (port, log):
        message_id = enqueue(pg_engine, settings, f"http://127.0.0.1:{port}", "/flaky/2", 1)
        env = procs.daemon_env(pg_url, key, encryption_key=secret)
        daemon = procs.start_daemon(env, tmp_path / "d.log")
        try:
            assert procs.wait_until(lambda: finished(pg_engine, 1), 60), states(pg_engine)
            monkeypatch.setenv("OUTBOX_DATABASE_URL", pg_url)
            assert cli(["replay", str(message_id)]) == 0
            capsys.readouterr()
            assert procs.wait_until(lambda: len(procs.arrivals(log)) >= 4 and finished(pg_engine, 1), 60)
        finally:
            assert procs.stop(daemon) == 0
    arrivals = procs.arrivals(log)
    assert [a["status"] for a in arrivals] == [503, 503, 200, 200]
    assert all(a["verified"] for a in arrivals)
    assert {a["sha256"] for a in arrivals} == {sent_bytes(pg_engine, message_id, settings)}
    assert stored.row(pg_engine, message_id).body_key_id == settings.sealing().active_id


def test_rotation_mid_run_reseals_everything_while_messages_keep_arriving(pg_engine, pg_url, tmp_path):
    key, jwks = procs.make_key(tmp_path)
    old, new = new_key(), new_key()
    total, switch_at = 240, 120
    ids: list[int] = []
    with procs.receiver(tmp_path, jwks) as (port, log):
        base = f"http://127.0.0.1:{port}"
        rotated = threading.Event()

        def produce() -> None:  # a seller enqueueing throughout; its config rotates halfway
            for i in range(total):
                if i == switch_at:
                    rotated.wait(60)
                ids.append(enqueue(pg_engine, producer_settings(new if i >= switch_at else old), base,
                                   "/flaky/1" if i % 5 == 0 else "/ok", i))
                time.sleep(0.01)

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        first = procs.start_daemon(procs.daemon_env(pg_url, key, encryption_key=old), tmp_path / "d1.log")
        try:
            assert procs.wait_until(lambda: len(ids) >= switch_at and len(procs.arrivals(log)) >= 20, 90)
        finally:
            assert procs.stop(first) == 0  # a rolling restart onto the rotated configuration
        second = procs.start_daemon(procs.daemon_env(pg_url, key, encryption_key=new, encryption_old_keys=old),
                                    tmp_path / "d2.log")
        rotated.set()
        try:
            producer.join(120)
            assert procs.wait_until(lambda: finished(pg_engine, total), 90), states(pg_engine)
            active = producer_settings(new).sealing().active_id
            with pg_engine.connect() as conn:
                def all_resealed() -> bool:
                    keys = conn.execute(select(messages.c.body_key_id)).scalars().all()
                    conn.rollback()
                    return set(keys) == {active}
                assert procs.wait_until(all_resealed, 60), "rows left under the old key"
        finally:
            assert procs.stop(second) == 0
    assert states(pg_engine)["delivered"] == total
    arrivals = procs.arrivals(log)
    assert arrivals and all(a["verified"] for a in arrivals), "every request verifies with the SDK"
    only_new = producer_settings(new)  # the old key is no longer needed to open anything
    expected = {sent_bytes(pg_engine, i, only_new) for i in ids}
    assert {a["sha256"] for a in arrivals} == expected
    assert "bodies.resealed" in (tmp_path / "d2.log").read_text()


def test_without_its_key_the_daemon_holds_sealed_messages_until_the_key_is_supplied(
        sqlite_url, sqlite_engine, tmp_path, monkeypatch, capsys):
    key, jwks = procs.make_key(tmp_path)
    secret = new_key()
    kid = producer_settings(secret).sealing().active_id
    port = free_port()
    with procs.receiver(tmp_path, jwks) as (receiver_port, log):
        ids = [enqueue(sqlite_engine, producer_settings(secret), f"http://127.0.0.1:{receiver_port}", "/ok", i)
               for i in range(3)]
        for missing in ({}, {"encryption_key": new_key()}):  # no key, then a wrong one
            daemon = procs.start_daemon(procs.daemon_env(sqlite_url, key, metrics_addr=f"127.0.0.1:{port}",
                                                         **missing), tmp_path / "held.log")
            try:
                assert procs.wait_until(lambda: held(port), 30), (tmp_path / "held.log").read_text()[-800:]
                status, line = procs.readyz(port)
                assert line.count("\n") == 1 and "OUTBOX_ENCRYPTION_OLD_KEYS" in line
                assert procs.wait_until(lambda: "encryption.rows_unopenable" in (tmp_path / "held.log").read_text(), 30)
                assert "outbox_sealed_rows_unopenable 3.0" in metrics(port)
                monkeypatch.setenv("OUTBOX_DATABASE_URL", sqlite_url)
                for name, value in missing.items():
                    monkeypatch.setenv(f"OUTBOX_{name.upper()}", value)
                assert cli(["status"]) == 1
                assert "HELD       3 message(s) to deliver are sealed under a key this configuration lacks" \
                    in capsys.readouterr().out
                assert cli(["encryption", "status"]) == 1
                assert f"under key(s) {kid} that this configuration cannot open" in capsys.readouterr().err
            finally:
                assert procs.stop(daemon) == 0
                monkeypatch.delenv("OUTBOX_ENCRYPTION_KEY", raising=False)
            assert procs.arrivals(log) == [] and states(sqlite_engine).get("dead", 0) == 0
            assert states(sqlite_engine)["pending"] == 3
        daemon = procs.start_daemon(procs.daemon_env(sqlite_url, key, encryption_key=secret), tmp_path / "d.log")
        try:
            assert procs.wait_until(lambda: finished(sqlite_engine, 3), 30), states(sqlite_engine)
        finally:
            assert procs.stop(daemon) == 0
        arrivals = procs.arrivals(log)
    assert states(sqlite_engine) == {"delivered": 3}
    assert sorted(a["sha256"] for a in arrivals) == sorted(sent_bytes(sqlite_engine, i, producer_settings(secret))
                                                           for i in ids)


def held(port: int) -> bool:
    try:
        status, line = procs.readyz(port)
    except OSError:  # not listening yet
        return False
    return status == 503 and "held" in line


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def test_a_daemon_without_the_agreed_key_leaves_the_messages_to_one_that_has_it(pg_engine, pg_url, tmp_path):
    """A daemon restarted with a stale configuration (the agreed key missing) beside one that
    has it: idle, it would win most due messages only to hold them again while the other
    waited. It claims nothing, says why on /readyz, and the daemon with the key sends all."""
    from outbox.keyset import read_ledger

    key, jwks = procs.make_key(tmp_path)
    old, new = new_key(), new_key()
    rotated = loopback_producer(OUTBOX_ENCRYPTION_KEY=new, OUTBOX_ENCRYPTION_OLD_KEYS=old)
    total, stale_port = 60, free_port()
    with procs.receiver(tmp_path, jwks) as (port, log):
        current = procs.start_daemon(procs.daemon_env(pg_url, key, encryption_key=new, encryption_old_keys=old),
                                     tmp_path / "current.log")
        stale = None
        try:
            def agreed() -> str | None:
                with pg_engine.connect() as conn:
                    return read_ledger(conn).sealing_key_id
            assert procs.wait_until(lambda: agreed() == rotated.sealing().active_id, 60)
            stale = procs.start_daemon(procs.daemon_env(pg_url, key, encryption_key=old,
                                                        metrics_addr=f"127.0.0.1:{stale_port}"), tmp_path / "stale.log")
            assert procs.wait_until(lambda: "lacks the agreed encryption key" in procs.readyz(stale_port)[1], 60), \
                procs.readyz(stale_port)
            for i in range(total):
                enqueue(pg_engine, rotated, f"http://127.0.0.1:{port}", "/ok", i)
            assert procs.wait_until(lambda: finished(pg_engine, total), 60), states(pg_engine)
            claimed = [line for line in metrics(stale_port).splitlines()
                       if line.startswith("outbox_claim_batch_size_sum")]
        finally:
            for daemon in (current, stale):
                if daemon is not None:
                    assert procs.stop(daemon) == 0
    assert claimed == ["outbox_claim_batch_size_sum 0.0"], claimed
    assert states(pg_engine)["delivered"] == total and len(procs.arrivals(log)) == total
    assert "encryption.claims_yielded" in (tmp_path / "stale.log").read_text()
