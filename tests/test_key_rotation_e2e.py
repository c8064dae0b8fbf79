"""The documented key rotation (docs/encryption.md), end to end with real processes.

Daemons and seller processes enqueue and deliver throughout while each is rolled, one at a
time, onto the new key in the worst order: a producer and a daemon with the new
configuration first, beside processes that cannot open the new key yet. Nothing may be
sealed under the new key before every live process opens it; afterwards everything moves
onto it, the old key is removed once ``outboxd encryption status`` says nothing needs it,
and account events to Bearer and HMAC subscribers registered under the old key still go out.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import outbox
from outbox.keyset import stop_reporting
from outbox.sealing import key_id
from supervisor.cli import main as cli
from tests import procs
from tests.ledger import loopback_producer, states

pytestmark = pytest.mark.e2e
ACCOUNT = "acct_rotation"
AGENT = "https://seller.example/adcp"
BEARER, HMAC = "bearer-credential-" + "b" * 30, "hmac-credential-" + "h" * 32


def new_key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


def kid(key: str) -> str:
    return key_id(base64.b64decode(key))


def config(active: str, *older: str) -> dict[str, str]:
    extra = {"OUTBOX_ENCRYPTION_OLD_KEYS": ",".join(older)} if older else {}
    return {"OUTBOX_ENCRYPTION_KEY": active, **extra}


class Fleet:
    """The daemons and seller processes of one deployment, each rolled by replacing it."""

    def __init__(self, url: str, signing_key: Path, receiver: str, directory: Path) -> None:
        self.url, self.signing_key, self.receiver, self.dir = url, signing_key, receiver, directory
        self.daemons: dict[int, subprocess.Popen[bytes]] = {}
        self.producers: dict[int, tuple[subprocess.Popen[bytes], Path]] = {}
        self.started = 0

    def env(self, keys: dict[str, str]) -> dict[str, str]:
        env = procs.daemon_env(self.url, self.signing_key, seller_agent_url=AGENT)
        return {**{k: v for k, v in env.items() if not k.startswith("OUTBOX_ENCRYPTION")}, **keys,
                "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}

    def roll(self, kinds: list[tuple[str, int]], keys: dict[str, str]) -> list[Path]:
        """Replace each (``"daemon"`` | ``"producer"``, index) with a process configured with
        ``keys``: all started together, each old one stopped once its successor runs (a
        surge roll). Returns the new producers' records."""
        started = [(kind, i, self._start(kind, keys)) for kind, i in kinds]
        outputs = []
        for kind, i, (proc, ready, out, stop) in started:
            assert procs.wait_until(ready, 30), f"{kind} {i} did not start"
            if kind == "daemon":
                old = self.daemons.get(i)
                self.daemons[i] = proc
                if old is not None:
                    assert procs.stop(old) == 0
            else:
                outputs.append(out)
                old_producer = self.producers.get(i)
                self.producers[i] = (proc, stop)
                if old_producer is not None:
                    self.stop_producer(*old_producer)
        return outputs

    def _start(self, kind: str, keys: dict[str, str]) -> tuple[subprocess.Popen[bytes], Any, Path, Path]:
        self.started += 1
        log = self.dir / f"{kind}.{self.started}.log"
        out, stop = self.dir / f"producer.{self.started}.jsonl", self.dir / f"stop.{self.started}"
        if kind == "daemon":
            proc = procs.start_daemon(self.env(keys), log)
            return proc, lambda: "daemon.started" in log.read_text(), out, stop
        proc = subprocess.Popen([sys.executable, "-m", "tests.rotation_producer", "--url", f"{self.receiver}/ok",
                                 "--name", f"p{self.started}", "--out", str(out), "--stop", str(stop)],
                                env=self.env(keys), stdout=open(log, "ab"), stderr=subprocess.STDOUT)
        return proc, lambda: out.exists() and out.read_text().count("\n") >= 3, out, stop

    @staticmethod
    def stop_producer(proc: subprocess.Popen[bytes], stop: Path) -> None:
        stop.touch()
        assert proc.wait(30) == 0

    def close(self) -> None:
        for proc, stop in self.producers.values():
            self.stop_producer(proc, stop)
        self.producers.clear()

    def kill_all(self) -> None:
        for proc in [*self.daemons.values(), *(p for p, _ in self.producers.values())]:
            if proc.poll() is None:
                proc.kill()


def encryption_status(monkeypatch, capsys, url: str, keys: dict[str, str]) -> dict:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", url)
    monkeypatch.delenv("OUTBOX_ENCRYPTION_OLD_KEYS", raising=False)
    for name, value in keys.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert cli(["encryption", "status", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def settings_of(keys: dict[str, str]) -> outbox.Settings:
    return loopback_producer(OUTBOX_SELLER_AGENT_URL=AGENT, **keys)


def register_subscribers(engine, base: str, settings: outbox.Settings) -> None:
    for sid, scheme, credential in (("bearer", "Bearer", BEARER), ("hmac", "HMAC-SHA256", HMAC)):
        with engine.begin() as conn:
            outbox.register_subscriber(conn, tenant_id="rotation", account_id=ACCOUNT, settings=settings,
                                       notification_config={
                                           "subscriber_id": sid, "url": f"{base}/ok/{sid}",
                                           "event_types": ["account.status_changed"],
                                           "authentication": {"schemes": [scheme], "credentials": credential}})


def fire_event(engine, settings: outbox.Settings) -> list[str]:
    with engine.begin() as conn:
        fired = outbox.enqueue_event(conn, tenant_id="rotation", account_id=ACCOUNT,
                                     notification_type="account.status_changed", settings=settings,
                                     payload={"account_id": ACCOUNT, "previous_status": "pending_approval",
                                              "status": "active", "observed_at": "2026-12-02T10:00:00Z",
                                              "reason_code": "seller_approved"})
    return [m.idempotency_key for m in fired]


@pytest.mark.parametrize("db, replicas", [("postgresql", 2), ("sqlite", 1)])
def test_a_rolling_rotation_in_the_worst_order_loses_nothing(db, replicas, request, tmp_path, monkeypatch, capsys):
    engine = request.getfixturevalue("pg_engine" if db == "postgresql" else "sqlite_engine")
    url = request.getfixturevalue("pg_url" if db == "postgresql" else "sqlite_url")
    old, new = new_key(), new_key()
    before, during, after = config(old), config(new, old), config(new)
    signing_key, jwks = procs.make_key(tmp_path)
    outputs: list[Path] = []
    with procs.receiver(tmp_path, jwks, log_bodies=True) as (port, log):
        base = f"http://127.0.0.1:{port}"
        register_subscribers(engine, base, settings_of(before))
        stop_reporting(engine)  # this seller is done with the old configuration
        fleet = Fleet(url, signing_key, base, tmp_path)
        try:
            everyone = [(kind, i) for i in range(replicas) for kind in ("daemon", "producer")]
            outputs += fleet.roll(everyone, before)
            for i in range(replicas):  # the worst order: a new-configuration producer, then a daemon, first
                outputs += fleet.roll([("producer", i)], during)
                # Daemon i cannot open the new key yet: the new producer keeps sealing under the old one.
                sealed = {line["sealed_under"] for line in procs.json_lines(outputs[-1])}
                assert sealed == {kid(old)}, "a new key sealed before every process could open it"
                fleet.roll([("daemon", i)], during)
            assert procs.wait_until(
                lambda: encryption_status(monkeypatch, capsys, url, during)["sealing_key_id"] == kid(new), 40)

            def old_key_removable() -> bool:
                entries = encryption_status(monkeypatch, capsys, url, during)["keys"]
                return any(e["key_id"] == kid(old) and e["removable"] for e in entries)

            assert procs.wait_until(old_key_removable, 40), encryption_status(monkeypatch, capsys, url, during)
            outputs += fleet.roll(everyone, after)  # the old key leaves every configuration
            fired = fire_event(engine, settings_of(after))
            fleet.close()
            enqueued = [line for out in outputs for line in procs.json_lines(out)]
            keys = {e["key"] for e in enqueued} | set(fired)

            def all_arrived() -> bool:
                return {a["key"] for a in procs.arrivals(log) if a["status"] == 200} >= keys

            assert procs.wait_until(all_arrived, 60), states(engine)
            assert procs.wait_until(lambda: states(engine)["pending"] + states(engine)["in_flight"] == 0, 30)
            for i, proc in fleet.daemons.items():
                assert procs.stop(proc) == 0, f"daemon {i}"
        finally:
            fleet.kill_all()
        arrivals = procs.arrivals(log)
    assert states(engine)["dead"] == 0
    assert len(enqueued) > 20 * replicas
    delivered = collections.Counter(a["key"] for a in arrivals if a["type"] != "webhook.challenge")
    assert set(delivered) == keys and set(delivered.values()) == {1}, "every message delivered once"
    sent = {a["key"]: a["sha256"] for a in arrivals}
    assert all(sent[e["key"]] == e["sha256"] for e in enqueued), "every body sent as rendered"
    assert all(a["verified"] for a in arrivals if a["type"] != "account.status_changed")
    events = {a["path"]: a for a in arrivals if a["type"] == "account.status_changed"}
    assert set(events) == {"/ok/bearer", "/ok/hmac"}
    assert events["/ok/bearer"]["authorization"] == f"Bearer {BEARER}"
    final = encryption_status(monkeypatch, capsys, url, after)
    assert final["sealing_key_id"] == kid(new) and final["unopenable_rows"] == 0
    assert {tuple(sorted(e["rows"])) for e in final["keys"] if e["key_id"] == kid(new)} == {
        ("message bodies", "message credentials", "subscriber credentials")}
    assert all(not e["rows"] for e in final["keys"] if e["key_id"] == kid(old))


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory) -> Path:
    """The code of the release before the agreed keys, as shipped (f09e755)."""
    root = tmp_path_factory.mktemp("previous-release")
    archive = subprocess.run(["git", "archive", "f09e755", "outbox", "supervisor", "sinks", "pyproject.toml"],
                             cwd=Path(__file__).resolve().parent.parent, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


def test_a_previous_release_daemon_holds_the_rotation_back_while_it_delivers(
        previous_release, pg_engine, pg_url, tmp_path, monkeypatch, capsys):
    old, new = new_key(), new_key()
    signing_key, jwks = procs.make_key(tmp_path)
    with procs.receiver(tmp_path, jwks) as (port, log):
        fleet = Fleet(pg_url, signing_key, f"http://127.0.0.1:{port}", tmp_path)
        legacy_log = tmp_path / "previous-release.log"
        legacy = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run"], cwd=previous_release,
                                  env={**fleet.env(config(old)), "PYTHONPATH": str(previous_release)},
                                  stdout=open(legacy_log, "ab"), stderr=subprocess.STDOUT)
        try:
            assert procs.wait_until(lambda: "daemon.started" in legacy_log.read_text(), 30), \
                legacy_log.read_text()[-800:]
            outputs = fleet.roll([("producer", 0), ("daemon", 0)], config(new, old))  # this release, rotated
            assert procs.wait_until(lambda: outputs[0].read_text().count("\n") >= 60, 30)
            assert encryption_status(monkeypatch, capsys, pg_url, config(new, old))["sealing_key_id"] is None
            sealed = {line["sealed_under"] for line in procs.json_lines(outputs[0])}
            assert sealed == {kid(old)}, "a key sealed that the previous release's daemon cannot open"
            assert procs.stop(legacy) == 0
            assert procs.wait_until(  # its attempts age out: the rotation goes on
                lambda: encryption_status(monkeypatch, capsys, pg_url, config(new, old))["sealing_key_id"] == kid(new),
                40)
            assert procs.wait_until(lambda: f'"sealed_under": "{kid(new)}"' in outputs[0].read_text(), 20), \
                "the producer follows the agreement"
            fleet.close()
            enqueued = procs.json_lines(outputs[0])
            keys = {e["key"] for e in enqueued}
            assert procs.wait_until(lambda: {a["key"] for a in procs.arrivals(log)} >= keys, 40), states(pg_engine)
            assert procs.stop(fleet.daemons[0]) == 0
        finally:
            fleet.kill_all()
            if legacy.poll() is None:
                legacy.kill()
        arrivals = procs.arrivals(log)
    assert states(pg_engine)["dead"] == 0
    delivered = collections.Counter(a["key"] for a in arrivals if a["status"] == 200)
    assert all(delivered[k] == 1 for k in keys), "every message delivered once"
    sent = {a["key"]: a["sha256"] for a in arrivals}
    assert all(sent[e["key"]] == e["sha256"] for e in enqueued), "every body sent as rendered"
    assert "delivery.attempt" in legacy_log.read_text()  # it delivered beside the rotated processes
