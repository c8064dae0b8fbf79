"""End to end: two real daemons on one PostgreSQL rotate and revoke keys while delivering.

The receiver verifies every request with the adcp SDK against the JWKS (and the signed
revocation list) it fetches from the daemons at that moment, as a buyer whose cache just
expired would. The cache window is shortened to 10 s so the test can wait it out; every
other setting is the e2e default.
"""

from __future__ import annotations

import collections
import json
import threading
import time
import urllib.request

import pytest
from adcp.signing import CachingRevocationChecker, FetchResult, StaticJwksResolver
from sqlalchemy import select

from outbox.schema import attempts, messages
from supervisor.keys import keyring
from supervisor.keys.keyring import KeyringError
from tests import procs
from tests.ledger import task_webhook
from tests.procs import free_port

pytestmark = pytest.mark.e2e
ISSUER = "https://seller.example.com"
CACHE_WINDOW = 10.0


def fetch(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def kids(url: str) -> list[str]:
    return [k["kid"] for k in fetch(url)["keys"]]


def enqueue(engine, base: str, path: str, n: int, tenant: str = "acme") -> str:
    with engine.begin() as conn:
        return task_webhook(conn, f"task_{n}", f"{base}{path}", tenant=tenant).idempotency_key


def keyid(arrival: dict) -> str:
    return arrival["keyid"]


def created(arrival: dict) -> int:
    return int(arrival["signature_input"].split(";created=")[1].split(";")[0])


def test_two_daemons_rotate_and_revoke_while_delivering(pg_engine, pg_url, tmp_path):
    key, _ = procs.make_key(tmp_path)
    ports = [free_port(), free_port()]
    # The receiver fetches two documents per request: give it the default read timeout.
    envs = [procs.daemon_env(pg_url, key, metrics_addr=f"127.0.0.1:{p}", key_cache_window_seconds=CACHE_WINDOW,
                             revocation_issuer=ISSUER, read_timeout_seconds=10, lease_seconds=30,
                             breaker_failure_threshold=100)  # the flaky buyer must not trip it
            for p in ports]
    jwks_urls = [f"http://127.0.0.1:{p}/.well-known/jwks.json" for p in ports]
    revocations_url = f"http://127.0.0.1:{ports[0]}/.well-known/governance-revocations.json"
    extra = [a for url in jwks_urls for a in ("--jwks-url", url)]
    extra += ["--revocation-url", revocations_url, "--revocation-issuer", ISSUER]
    with procs.receiver(tmp_path, None, extra=extra) as (port, log):
        base = f"http://127.0.0.1:{port}"
        daemons = [procs.start_daemon(env, tmp_path / f"d{i}.log") for i, env in enumerate(envs)]
        stop = threading.Event()
        sent: list[str] = []

        def produce() -> None:
            while not stop.is_set():
                sent.append(enqueue(pg_engine, base, "/ok", len(sent)))
                time.sleep(0.15)

        producer = threading.Thread(target=produce)
        try:
            assert procs.wait_until(lambda: all(_serves(u) for u in jwks_urls), 30), "daemons did not start"
            assert all(kids(u) == [procs.KEY_ID] for u in jwks_urls)  # the config key, seeded once
            producer.start()
            time.sleep(1.5)

            procs.outboxd(envs[0], "keys", "rotate", "--generate", str(tmp_path / "k2.pem"), "--kid", "k2", exit_code=0)
            # Refused early (in-process: a CLI start on a loaded machine takes seconds; the CLI's
            # refusal is tested in test_keyring.py).
            with pg_engine.begin() as conn, pytest.raises(KeyringError, match="or pass --force"):
                keyring.promote(conn, cache_window=CACHE_WINDOW)
            staged_at = time.time()
            assert procs.wait_until(lambda: all(kids(u) == [procs.KEY_ID, "k2"] for u in jwks_urls), 1.0, 0.05)

            time.sleep(max(0.0, staged_at + CACHE_WINDOW + 0.2 - time.time()))
            # Tried first before the switch, then every few seconds until well after it.
            flaky = enqueue(pg_engine, base, "/flaky/6", 10**6, tenant="flaky")
            procs.outboxd(envs[1], "keys", "promote", "--json", exit_code=0)
            with pg_engine.connect() as conn:
                switch_at = conn.exec_driver_sql(
                    "SELECT activates_at FROM outbox_signing_keys WHERE kid = 'k2'").scalar_one()
            time.sleep(max(0.0, switch_at + 3 - time.time()))
            assert all(kids(u) == [procs.KEY_ID, "k2"] for u in jwks_urls)  # the old key is retiring

            procs.outboxd(envs[0], "keys", "revoke", procs.KEY_ID, exit_code=0)
            assert procs.wait_until(lambda: all(kids(u) == ["k2"] for u in jwks_urls), 1.0, 0.05)
            _assert_revocation_list_lists(revocations_url, jwks_urls[0], procs.KEY_ID)
            time.sleep(1.5)
            jwks_cli = procs.outboxd(envs[0], "keys", "jwks")
            assert json.loads(jwks_cli.stdout) == fetch(jwks_urls[1])  # one document, CLI or endpoint
        finally:
            stop.set()
            if producer.is_alive():
                producer.join()
            total = len(sent) + 1
            delivered = procs.wait_until(lambda: _delivered(pg_engine) == total, 60)
            for daemon in daemons:
                assert procs.stop(daemon) == 0
        assert delivered, f"{_delivered(pg_engine)} of {total} delivered"
        arrivals = procs.arrivals(log)

    assert arrivals and all(a["verified"] for a in arrivals), [a for a in arrivals if not a["verified"]][:3]
    # Nothing signed by a next key (k2 before the switch), a retiring or a revoked one (k1 after):
    # a request arrives after it was signed, and `created` is the signing time's whole second.
    for a in arrivals:
        if keyid(a) == "k2":
            assert a["t"] >= switch_at and created(a) >= int(switch_at), a
        else:
            assert keyid(a) == procs.KEY_ID and created(a) <= switch_at, a
    # The message retried across the rotation carries the new keyid on its later attempts.
    retried = [keyid(a) for a in arrivals if a["key"] == flaky]
    assert len(retried) == 7 and retried[0] == procs.KEY_ID and retried[-1] == "k2", retried

    # Each daemon switched at the switch instant, whichever attempts it happened to claim: its
    # last old signature was made before it and its first new one not before it (`created` is
    # the signing time's whole second). When a daemon's first new signature comes depends on
    # when it next wins a claim against the other daemon, not on the switch, so it is printed,
    # not bounded. (Arrival times would measure the receiver, which verifies one request at a
    # time and falls seconds behind on a loaded machine.)
    by_daemon = _arrivals_by_daemon(pg_engine, arrivals)
    assert len(by_daemon) == 2
    for daemon_id, seen in by_daemon.items():
        last_old = max(created(a) for a in seen if keyid(a) == procs.KEY_ID)
        first_new = min(created(a) for a in seen if keyid(a) == "k2")
        print(f"{daemon_id}: switch at {switch_at:.3f}; last {procs.KEY_ID} signature created {last_old}, "
              f"first k2 created {first_new}; receiver lag up to "
              f"{max(a['t'] - created(a) for a in seen):.1f} s")
        assert last_old <= switch_at and int(switch_at) <= first_new, daemon_id
        assert all(keyid(a) == "k2" for a in seen if created(a) > switch_at), daemon_id


def _serves(url: str) -> bool:
    try:
        fetch(url)
        return True
    except OSError:
        return False


def _delivered(engine) -> int:
    with engine.connect() as conn:
        return conn.exec_driver_sql("SELECT count(*) FROM outbox_messages WHERE state = 'delivered'").scalar_one()


def _assert_revocation_list_lists(url: str, jwks_url: str, kid: str) -> None:
    """The SDK fetches the signed list, verifies it against the served JWKS, and finds ``kid``."""
    checker = CachingRevocationChecker(revocation_uri=url, issuer=ISSUER,
                                       jwks_resolver=StaticJwksResolver(fetch(jwks_url)),
                                       fetcher=lambda uri, **_: FetchResult(body=fetch(uri), etag=None))
    assert checker(kid) is True and checker("k2") is False


def _arrivals_by_daemon(engine, arrivals: list[dict]) -> dict[str, list[dict]]:
    """Arrivals of single-attempt messages, by the daemon that made the attempt."""
    with engine.connect() as conn:
        made_by = collections.defaultdict(set)
        for key, daemon_id in conn.execute(select(messages.c.idempotency_key, attempts.c.daemon_id)
                                           .join(attempts, attempts.c.message_id == messages.c.id)
                                           .where(messages.c.attempts == 1)):
            made_by[key].add(daemon_id)
    grouped: dict[str, list[dict]] = collections.defaultdict(list)
    for a in arrivals:
        if len(made_by.get(a["key"], ())) == 1:
            grouped[next(iter(made_by[a["key"]]))].append(a)
    return grouped
