"""A failed answer's body as the operator sees it: a short, masked, printable excerpt on the
attempt row, escaped on the console, in ``outboxd show --json``, and nowhere else.

A real daemon posts to a real receiver on 127.0.0.1 that answers 503 with a hostile body
(control characters, a bidirectional override, a bearer token, a password field, a script
tag, 10 KB of filler); the migration is checked on PostgreSQL (partitioned) and SQLite.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from alembic import command
from hypothesis import given, settings as hsettings, strategies as st
from sqlalchemy import inspect, select, text

import outbox
from outbox.masking import EXCERPT_CHARS, REDACTED, response_excerpt
from outbox.migrate import alembic_config, upgrade
from outbox.schema import attempts
from supervisor.wire.http1 import ERROR_BODY_KEPT
from supervisor.wire.transport import HttpSender
from tests import procs
from tests.ledger import THROWAWAY_KEY, loopback_producer
from tests.console_driver import console, signed_in  # noqa: F401 (fixture)

BEARER = "sk_live_4f9a8b7c6d5e4f3a2b1c0d"
PASSWORD = "hunter2"
MARKER = "RECEIVER-SAYS-DOWN"
HOSTILE = (b"\x00\x1b[31m<script>alert(1)</script>\r\nAuthorization: Bearer " + BEARER.encode()
           + b"\r\n\x7f\xc2\x85\xe2\x80\xae {\"password\": \"" + PASSWORD.encode() + b"\"} " + MARKER.encode()
           + b" " + b"x" * 10_240)
SETTINGS = loopback_producer(OUTBOX_ENCRYPTION_KEY=THROWAWAY_KEY)
UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


class _Receiver(BaseHTTPRequestHandler):
    """``/down`` answers 503 with :data:`HOSTILE`; anything else 200 with a body."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        status, body = (503, HOSTILE) if self.path == "/down" else (200, f"ok {MARKER}".encode())
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def check_excerpt(excerpt: str) -> None:
    """What every stored excerpt of :data:`HOSTILE` must be."""
    assert 0 < len(excerpt) <= EXCERPT_CHARS and not UNPRINTABLE.search(excerpt)
    assert BEARER not in excerpt and PASSWORD not in excerpt and REDACTED in excerpt
    assert "<script>alert(1)</script>" in excerpt and MARKER in excerpt  # the text itself, masked only


def test_the_excerpt_of_a_hostile_body_is_one_short_masked_line() -> None:
    excerpt = response_excerpt(HOSTILE[:ERROR_BODY_KEPT], cut=True)
    check_excerpt(excerpt)
    assert excerpt.endswith(f"{MARKER} …")  # the filler, cut mid-word, is dropped whole
    assert response_excerpt(b"", cut=False) is None and response_excerpt(b"\r\n\x00 ", cut=False) is None
    assert response_excerpt(b"x" * ERROR_BODY_KEPT, cut=True) is None  # one cut word: nothing to trust
    assert response_excerpt(b"\xff\xfeQueue full", cut=False) == "\ufffd\ufffdQueue full"
    assert response_excerpt(b"see https://cb.example/x?sig=abc&user=1 later", cut=False) == \
        "see https://cb.example/x later"


@hsettings(max_examples=300, deadline=None)
@given(prefix=st.binary(max_size=80), suffix=st.binary(max_size=80),
       secret=st.from_regex(r"[0-9a-f]{24}", fullmatch=True).filter(lambda s: len(set(s)) >= 10 and
                                                                   any(c.isalpha() for c in s) and
                                                                   any(c.isdigit() for c in s)),
       form=st.sampled_from(["Bearer {}", "token={}", '"api_key": "{}"', "{}", "client_secret: {}"]),
       cut=st.booleans())
def test_any_body_gives_a_printable_bounded_line_without_the_secret(prefix: bytes, suffix: bytes, secret: str,
                                                                    form: str, cut: bool) -> None:
    excerpt = response_excerpt(prefix + b" " + form.format(secret).encode() + b" " + suffix, cut=cut)
    assert excerpt is None or (0 < len(excerpt) <= EXCERPT_CHARS and not UNPRINTABLE.search(excerpt)
                               and secret not in excerpt and excerpt == excerpt.strip())


async def test_a_failed_answer_holds_only_its_first_bytes_and_the_connection_is_reused(receiver: str,
                                                                                     settings) -> None:
    sender = HttpSender(settings)
    try:
        failed = await sender.post(f"{receiver}/down", b"{}", {"Content-Type": "application/json"})
        again = await sender.post(f"{receiver}/down", b"{}", {"Content-Type": "application/json"})
        ok = await sender.post(f"{receiver}/up", b"{}", {"Content-Type": "application/json"})
    finally:
        await sender.aclose()
    assert (failed.status, failed.body) == (again.status, again.body) == (503, HOSTILE[:ERROR_BODY_KEPT])
    assert (ok.status, ok.body) == (200, f"ok {MARKER}".encode())  # a 2xx body is kept whole (proofs read it)


def test_migration_adds_the_column_to_history_and_every_partition(blank_engine) -> None:
    engine = blank_engine
    upgrade(engine, "0014_due_endpoints")
    old_insert = text("INSERT INTO outbox_attempts (message_id, tenant_id, url, attempt_number, outcome, will_retry,"
                      " idempotency_key, trigger) VALUES (1, 't1', 'https://b.example/h', 1, 'failed', true, 'k', "
                      "'scheduled')")
    with engine.begin() as conn:
        conn.execute(old_insert)
    upgrade(engine)
    with engine.begin() as conn:
        conn.execute(old_insert)  # a daemon of the previous release, after the upgrade
        conn.execute(attempts.insert().values(message_id=2, tenant_id="t1", url="https://b.example/h",
                                              attempt_number=1, outcome="failed", will_retry=True,
                                              idempotency_key="k2", trigger="scheduled", response_excerpt="busy"))
        assert conn.execute(select(attempts.c.response_excerpt).order_by(attempts.c.id)).scalars().all() == \
            [None, None, "busy"]
        if engine.dialect.name == "postgresql":
            missing = conn.execute(text(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "WHERE i.inhparent = 'outbox_attempts'::regclass AND NOT EXISTS (SELECT 1 FROM pg_attribute a "
                "WHERE a.attrelid = c.oid AND a.attname = 'response_excerpt')")).all()
            partitions = conn.execute(text("SELECT count(*) FROM pg_inherits WHERE inhparent = "
                                           "'outbox_attempts'::regclass")).scalar_one()
            assert missing == [] and partitions > 1
    with engine.begin() as conn:
        command.downgrade(alembic_config(conn), "0014_due_endpoints")
    assert "response_excerpt" not in {c["name"] for c in inspect(engine).get_columns("outbox_attempts")}


def test_a_daemon_records_the_masked_excerpt_and_only_the_operator_sees_it(pg_engine, pg_url, console, receiver,
                                                                           tmp_path) -> None:
    with pg_engine.begin() as conn:
        down = outbox.enqueue(conn, tenant_id="t1", url=f"{receiver}/down",
                              payload={"idempotency_key": "whk_excerpt_down_0001"}, notification_type="delayed",
                              settings=SETTINGS)
        up = outbox.enqueue(conn, tenant_id="t1", url=f"{receiver}/up",
                            payload={"idempotency_key": "whk_excerpt_up_000001"}, settings=SETTINGS)
    pem, _ = procs.make_key(tmp_path)
    log = tmp_path / "daemon.log"
    env = procs.daemon_env(pg_url, pem, encryption_key=THROWAWAY_KEY)
    daemon = procs.start_daemon(env, log)

    def recorded() -> list:
        with pg_engine.connect() as conn:
            return conn.execute(select(attempts).order_by(attempts.c.id)).all()

    try:
        assert procs.wait_until(lambda: len([r for r in recorded() if r.message_id == down.id]) >= 2
                                and any(r.message_id == up.id for r in recorded()), 90)
    finally:
        assert procs.stop(daemon) == 0
    rows = recorded()
    failed = [r for r in rows if r.message_id == down.id]
    assert all(r.http_status == 503 for r in failed)
    for row in failed:
        check_excerpt(row.response_excerpt)
        assert MARKER not in (row.error or "")
    assert [r.response_excerpt for r in rows if r.message_id == up.id] == [None]  # no excerpt for 2xx

    logged = log.read_text()
    assert "delivery.attempt" in logged and MARKER not in logged and BEARER not in logged and "alert(1)" not in logged
    with pg_engine.connect() as conn:
        activity = json.dumps(outbox.webhook_activity(conn, tenant_id="t1", settings=SETTINGS))
    assert '"failed"' in activity and MARKER not in activity and "alert(1)" not in activity

    client, _ = signed_in(console)
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;"
    for page in (client.get(f"/messages/{down.id}").text,
                 client.get("/endpoint", params={"tenant": "t1", "origin": receiver}).text):
        assert escaped in page and "<script>alert" not in page and MARKER in page and BEARER not in page

    shown = subprocess.run([sys.executable, "-m", "supervisor.cli", "show", str(down.id), "--json"], env=env,
                           capture_output=True, text=True, check=True)
    trail = json.loads(shown.stdout)["attempt_trail"]
    assert [a["response_excerpt"] for a in trail] == [r.response_excerpt for r in failed]
