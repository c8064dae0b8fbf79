"""A scope with no active signing key pauses its deliveries: nothing sent, no attempt burned.

End to end with the real daemon: revoking the only active key holds every message (no
attempt row, no attempt counted, never dead), says so in one line in the log, ``/readyz``
and ``outboxd status``; a daemon restarted meanwhile runs paused instead of exiting; and
promoting a new key delivers each message on its first attempt.
"""

from __future__ import annotations

import time
import urllib.request

import pytest
from sqlalchemy import func, select

from outbox.schema import attempts, messages
from tests import procs
from tests.ledger import task_webhook

pytestmark = pytest.mark.e2e
PAUSED = "the default scope has no active signing key: its deliveries are paused"


def _enqueue(engine, url: str, count: int) -> None:
    with engine.begin() as conn:
        for i in range(count):
            task_webhook(conn, f"task_{i}", f"{url}?n={i}")


def _rows(engine) -> list:
    with engine.connect() as conn:
        return list(conn.execute(select(messages.c.state, messages.c.attempts, messages.c.last_error)))


def _active_keys_gauge(port: int) -> set[str]:
    """The values of ``outbox_signing_active_keys`` (one series per scope) on ``/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {line.rsplit(" ", 1)[1].removesuffix(".0") for line in text.splitlines()
            if line.startswith("outbox_signing_active_keys{")}


def _attempt_rows(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(attempts)).scalar_one()


def test_revoking_the_active_key_pauses_its_scope_until_a_key_is_promoted(pg_engine, pg_url, tmp_path) -> None:
    key, _ = procs.make_key(tmp_path)
    metrics_port = procs.free_port()
    env = procs.daemon_env(pg_url, key, metrics_addr=f"127.0.0.1:{metrics_port}")
    log = tmp_path / "d.log"
    with procs.receiver(tmp_path, None) as (port, arrivals_log):
        daemon = procs.start_daemon(env, log)
        try:
            assert procs.wait_until(lambda: b"daemon.started" in log.read_bytes(), 60), log.read_text()[-2000:]
            procs.outboxd(env, "keys", "revoke", procs.KEY_ID, exit_code=0)
            assert procs.wait_until(lambda: b"keyring.scope_paused" in log.read_bytes(), 30)
            _enqueue(pg_engine, f"http://127.0.0.1:{port}/ok", 3)
            # Claimed, found unsignable and handed back (no attempt), more than once.
            assert procs.wait_until(lambda: all(r.last_error and PAUSED in r.last_error for r in _rows(pg_engine)), 30)
            time.sleep(6)  # past one recheck: still nothing burned
            assert [(r.state, r.attempts) for r in _rows(pg_engine)] == [("pending", 0)] * 3
            assert _attempt_rows(pg_engine) == 0 and procs.arrivals(arrivals_log) == []
            status, body = procs.readyz(metrics_port)
            assert status == 200 and PAUSED in body and body.count("\n") == 1, body
            assert _active_keys_gauge(metrics_port) == {"0"}, "the alert's gauge says the scope has no key"
            shown = procs.outboxd(env, "status", exit_code=1).stdout  # held messages fail the command
            assert any(line.startswith("signing") and PAUSED in line and "`outboxd keys rotate --generate FILE`"
                       in line for line in shown.splitlines()), shown
        finally:
            assert procs.stop(daemon) == 0
        paused_lines = [line for line in log.read_text().splitlines() if "keyring.scope_paused" in line]
        assert len(paused_lines) == 1 and "outboxd keys rotate" in paused_lines[0], paused_lines

        restarted_log = tmp_path / "d2.log"
        daemon = procs.start_daemon(env, restarted_log)  # no active key at all: runs paused, says so
        try:
            assert procs.wait_until(
                lambda: b"daemon.started" in restarted_log.read_bytes() or daemon.poll() is not None, 60)
            assert daemon.poll() is None, restarted_log.read_text()[-2000:]
            assert b"keyring.scope_paused" in restarted_log.read_bytes()
            procs.outboxd(env, "keys", "rotate", "--generate", str(tmp_path / "k2.pem"), "--kid", "k2", exit_code=0)
            procs.outboxd(env, "keys", "promote", "--force", exit_code=0)
            assert procs.wait_until(lambda: [r.state for r in _rows(pg_engine)] == ["delivered"] * 3, 60)
            assert [r.attempts for r in _rows(pg_engine)] == [1] * 3, "each delivered on its first attempt"
            assert _attempt_rows(pg_engine) == 3
            assert procs.wait_until(lambda: procs.readyz(metrics_port)[1] == "ready\n", 10)
            assert procs.wait_until(lambda: _active_keys_gauge(metrics_port) == {"1"}, 10)
            assert procs.wait_until(lambda: b"keyring.scope_resumed" in restarted_log.read_bytes(), 10)
        finally:
            assert procs.stop(daemon) == 0
        assert {a["keyid"] for a in procs.arrivals(arrivals_log)} == {"k2"}
