"""Both official buyer SDKs verify what outboxd sends with its defaults (docs/protocol.md, "Key purpose").

The oracles are the buyers' own verifiers: the Python ``adcp`` SDK's ``verify_webhook_signature``
and the TypeScript ``@adcp/sdk``'s ``verifyWebhookSignature`` (pinned in tests/node/package.json,
installed with npm). Neither is ours; the table in docs/protocol.md is what these tests measure.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import func, select

import outbox
from outbox.schema import messages
from outboxd_receiver.verifiers import adcp_verifier
from supervisor.wire.signing import ADCP_USE_REQUEST, ADCP_USE_WEBHOOK, ALG_ED25519, ALG_ES256, DEFAULT_ADCP_USE
from supervisor.wire.signing import SigningKey, signature_headers
from tests import procs, ts_sdk
from tests.ledger import PRODUCER

URL = "https://buyer.example/hooks/op_1?tenant=7"
BODY = b'{"idempotency_key":"whk_0123456789abcdef","task_id":"t1","status":"completed"}'
MESSAGES = 50
RETRIED_EVERY = 5  # every fifth webhook is answered 503 once, so retries are verified too


def _new_key(kid: str, alg: str) -> SigningKey:
    private = Ed25519PrivateKey.generate() if alg == ALG_ED25519 else ec.generate_private_key(ec.SECP256R1())
    return SigningKey(kid, alg, private)


def test_which_buyers_verify_which_key_purpose(ts_sdk_version: str) -> None:
    """Python adcp (AdCP 3.2) verifies both purposes; TypeScript @adcp/sdk (AdCP 3.0.6) only
    webhook-signing, refusing request-signing at its step 8; the default is the one both verify."""
    assert ts_sdk_version == "6.11.0"
    cases = [(_new_key(f"{alg}-{use}", alg), use) for alg in (ALG_ED25519, ALG_ES256)
             for use in (ADCP_USE_WEBHOOK, ADCP_USE_REQUEST)]
    jwks = {"keys": [key.public_jwk(use) for key, use in cases]}
    signed = [ts_sdk.Captured("POST", URL,
                              {k.lower(): v for k, v in signature_headers(key, url=URL, body=BODY).items()},
                              BODY) for key, _ in cases]
    python = adcp_verifier(jwks)
    typescript = ts_sdk.verify(jwks, signed)
    for (key, use), request, ts in zip(cases, signed, typescript):
        assert python("POST", URL, dict(request.headers), BODY) is None, (key.key_id, use)
        if use == ADCP_USE_WEBHOOK:
            assert ts == {"ok": True, "keyid": key.key_id}, ts
        else:
            assert (ts["ok"], ts["code"], ts["step"]) == (False, "webhook_mode_mismatch", 8), ts
    assert DEFAULT_ADCP_USE == ADCP_USE_WEBHOOK


class _Capture(BaseHTTPRequestHandler):
    """A buyer's endpoint that keeps every request for the verifiers and answers 200, or 503
    to the first arrival at a path under /retry/."""

    protocol_version = "HTTP/1.1"
    seen: list[ts_sdk.Captured] = []
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        url = f"http://{self.headers['Host']}{self.path}"
        with self.lock:
            first = all(r.url != url for r in self.seen)
            self.seen.append(ts_sdk.Captured("POST", url, {k.lower(): v for k, v in self.headers.items()}, body))
        status = 503 if first and self.path.startswith("/retry/") else 200
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def capture() -> Iterator[tuple[str, list[ts_sdk.Captured]]]:
    seen: list[ts_sdk.Captured] = []
    handler = type("Handler", (_Capture,), {"seen": seen, "lock": threading.Lock()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def _published_jwks(env: dict[str, str]) -> dict[str, Any]:
    """What the seller publishes: ``outboxd keys jwks``, run as an operator would."""
    done = subprocess.run([sys.executable, "-m", "supervisor.cli", "keys", "jwks"], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return dict(json.loads(done.stdout))


def test_every_webhook_of_a_default_run_verifies_under_both_sdks(pg_engine, pg_url, tmp_path: Path, capture,
                                                                 ts_sdk_version: str) -> None:
    base, seen = capture
    with pg_engine.begin() as conn:
        for i in range(MESSAGES):
            path = f"/retry/{i}" if i % RETRIED_EVERY == 0 else f"/ok/{i}"
            outbox.enqueue_task_webhook(
                conn, tenant_id=f"tenant-{i % 3}", task_id=f"task_{i}", task_type="create_media_buy",
                status="completed", result={"media_buy_id": f"mb_{i}"}, settings=PRODUCER,
                push_notification_config={"url": f"{base}{path}?n={i}", "operation_id": f"op_{i}"})
    key, _ = procs.make_key(tmp_path)  # a fresh key, registered by the daemon with the default purpose
    env = procs.daemon_env(pg_url, key)
    daemon = procs.start_daemon(env, tmp_path / "daemon.log")
    try:
        def delivered() -> int:
            with pg_engine.connect() as conn:
                return int(conn.execute(select(func.count()).where(messages.c.state == "delivered")).scalar_one())
        assert procs.wait_until(lambda: delivered() == MESSAGES, 120), (tmp_path / "daemon.log").read_text()[-3000:]
        jwks = _published_jwks(env)
    finally:
        assert procs.stop(daemon) == 0

    assert [k["adcp_use"] for k in jwks["keys"]] == [DEFAULT_ADCP_USE]
    arrivals = list(seen)
    per_url = collections.Counter(r.url for r in arrivals)
    assert len(per_url) == MESSAGES and len(arrivals) == MESSAGES + MESSAGES // RETRIED_EVERY, per_url
    python = adcp_verifier(jwks)
    assert [python(r.method, r.url, dict(r.headers), r.body) for r in arrivals] == [None] * len(arrivals)
    typescript = ts_sdk.verify(jwks, arrivals)
    assert [r["ok"] for r in typescript] == [True] * len(arrivals), [r for r in typescript if not r["ok"]][:3]


def _queries(count: int) -> list[str]:
    """Queries a buyer may register: the characters RFC 3986 allows raw in a query, escapes
    of every kind (lower and upper case hex, escaped unreserved and reserved characters),
    non-ASCII text and the characters outboxd escapes itself."""
    import random

    pieces = [*"abcXYZ019-._~!$&'()*+,;=:@/?", "%7e", "%7E", "%41", "%2f", "%2F", "%27", "%20", "%e2%82%ac",
              "\u00fc", "\u20ac", " ", '"', "<", ">", "{", "}", "|", "^", "`"]
    chance = random.Random(3986)
    return [f"q={''.join(chance.choice(pieces) for _ in range(chance.randint(1, 12)))}" for _ in range(count)]


def test_both_buyer_sdks_verify_every_query_as_outboxd_sends_it(ts_sdk_version: str) -> None:
    """The URL outboxd signs and sends (outbox.urls.canonicalize_url) is what both verifiers
    rebuild: the TypeScript one re-parses it as a WHATWG URL and normalizes its escapes, the
    Python one takes it as it arrives. A query kept byte for byte ("'" raw, "%7e", "%2f")
    verified with Python only."""
    from outbox.urls import canonicalize_url

    key = _new_key("queries", ALG_ED25519)
    jwks = {"keys": [key.public_jwk(ADCP_USE_WEBHOOK)]}
    named = ["q='x'", "a=%7e", "a=%2f", "id=%41bc", "a=%e2%82%ac&b=+", "next=%2F&x=~"]
    urls = [canonicalize_url(f"https://buyer.example:8443/hooks/op_1?{query}") for query in named + _queries(200)]
    signed = [ts_sdk.Captured("POST", url, {k.lower(): v for k, v in signature_headers(key, url=url, body=BODY).items()},
                              BODY) for url in urls]
    python = adcp_verifier(jwks)
    refused = [(url, ts) for url, ts in zip(urls, ts_sdk.verify(jwks, signed)) if not ts["ok"]]
    refused += [(r.url, why) for r in signed if (why := python("POST", r.url, dict(r.headers), BODY)) is not None]
    assert refused == [], refused[:5]
