"""Nothing secret printed, one origin function, sendable legacy credentials.

Real PostgreSQL and SQLite; the daemon's own claim, attempt and completer code records the
attempts, and the CLI prints them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st
from sqlalchemy import select, text

import outbox
from outbox import store
from outbox.db import make_async_engine
from outbox.errors import OutboxValidationError
from outbox.schema import attempts, messages
from outbox.sealing import CREDENTIAL
from outbox.urls import _URL_IN_TEXT, endpoint_origin, public_url, redact_urls
from sinks.fanout import SinkFanout
from supervisor.cycle.attempt import attempt
from supervisor.cli import main
from supervisor.cycle.completer import Completer
from supervisor.observe.metrics import Metrics
from supervisor.cycle.outage import OutageGuard
from supervisor.keys.keyring_cache import CachedKeyring
from supervisor.wire.signing import generate_signing_key_pem
from supervisor.wire.transport import HttpSender
from tests.cli_calls import cli, url_of
from tests.ledger import enqueue_many

SECRET = "SENTINEL"
REPORTING = {"url": f"https://buyer.example.com/reports?sig={SECRET}", "operation_id": "op_rep",
             "token": "reporttoken123456"}
DELIVERY = {"notification_type": "scheduled", "reporting_period": {"start": "2026-11-01T00:00:00Z",
            "end": "2026-11-02T00:00:00Z"}, "currency": "USD", "media_buy_deliveries": []}
PLAIN_URL = f"HTTPS://user:{SECRET}@Buyer.Example.COM:443/h?tok={SECRET}#{SECRET}"


def _plain_sql_row(conn, key: str, url: str, body: bytes | None = None) -> None:
    conn.execute(text("INSERT INTO outbox_messages (tenant_id, url, idempotency_key, body) VALUES ('t1', :u, :k, :b)"),
                 {"u": url, "k": key, "b": body if body is not None else json.dumps({"idempotency_key": key}).encode()})


async def _run_daemon_once(engine, settings, tmp_path) -> None:
    """One claim, the real attempt code, one completer flush (no request leaves for these rows)."""
    pem = tmp_path / "k.pem"
    pem.write_bytes(generate_signing_key_pem())
    async_engine = make_async_engine(engine.url.render_as_string(hide_password=False))
    sender = HttpSender(settings)
    keys = CachedKeyring(outbox.load_settings(env={}, signing_key_file=str(pem), signing_key_id="k"))
    try:
        await keys.start(async_engine)  # the daemon's keyring, seeded from the key file
        async with async_engine.begin() as conn:
            claimed = await store.claim(conn, limit=50, lease_seconds=30, horizon_seconds=86_400, daemon_id="unit",
                                        endpoint_concurrency=8)
        outcomes = [await attempt(m, settings=settings, keys=keys, sender=sender) for m in claimed]
        completer = Completer(async_engine, settings=settings, daemon_id="unit", metrics=Metrics(),
                              fanout=SinkFanout([], timeout=1), outage=OutageGuard(5))
        await completer._flush_until_done(outcomes)
    finally:
        await sender.aclose()
        await async_engine.dispose()


def _cli(capsys, monkeypatch, url: str, *args: str) -> tuple[int, str]:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", url)
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out + err


def test_cli_and_attempt_rows_carry_no_query_string_or_userinfo(engine, settings, tmp_path, capsys, monkeypatch):
    with engine.begin() as conn:
        report = outbox.enqueue_delivery_report(conn, tenant_id="t1", reporting_webhook=REPORTING,
                                                media_buy_id="mb_1", result=DELIVERY, settings=settings)
        _plain_sql_row(conn, "whk_plain_sql_userinfo_01", PLAIN_URL)
    asyncio.run(_run_daemon_once(engine, settings, tmp_path))  # the CLI runs its own event loop
    with engine.connect() as conn:
        row = conn.execute(select(messages).where(messages.c.idempotency_key == "whk_plain_sql_userinfo_01")).one()
        logged = conn.execute(select(attempts).where(attempts.c.message_id == row.id)).one()
    assert (row.state, row.dead_reason, row.origin) == ("dead", "invalid", "https://buyer.example.com")
    assert SECRET not in logged.url + (logged.error or "") and "user" not in logged.url
    url = engine.url.render_as_string(hide_password=False)
    for args in (["list"], ["list", "--json"], ["show", str(row.id)], ["show", str(row.id), "--json"],
                 ["show", str(report.id), "--json"], ["status", "--json"], ["breakers", "list", "--json"]):
        code, out = _cli(capsys, monkeypatch, url, *args)
        # The CLI runs without the encryption key the report was sealed with: status says the
        # report is held (exit 1), and no command prints a secret either way.
        assert code == (1 if args[0] == "status" else 0) and SECRET not in out and "user:" not in out, (args, out)
    code, out = _cli(capsys, monkeypatch, url, "show", str(report.id), "--json")
    assert json.loads(out)["sequence_key"].endswith("https://buyer.example.com/reports")


def test_show_by_a_key_two_tenants_share_asks_for_the_id(engine, settings, capsys, monkeypatch):
    key = "whk_shared_between_tenants"
    with engine.begin() as conn:
        for tenant in ("t1", "t2"):
            outbox.enqueue(conn, tenant_id=tenant, url="https://buyer.example.com/h",
                           payload={"idempotency_key": key}, settings=settings)
    code, out = _cli(capsys, monkeypatch, engine.url.render_as_string(hide_password=False), "show", key)
    assert code == 1 and "message id" in out and out.count("\n") == 1


async def test_the_daemon_gives_every_row_the_python_origin(engine, settings, tmp_path):
    """SQLite has no trigger, and a plain-SQL writer may set any origin: the claim fixes both."""
    body_not_json = b"not json"  # dead 'invalid' at its first attempt, so no request is made
    with engine.begin() as conn:
        _plain_sql_row(conn, "whk_plain_sql_origin_001", "https://Shop.Example.COM:443/x?a=1", body_not_json)
        conn.execute(text("INSERT INTO outbox_messages (tenant_id, url, origin, idempotency_key, body)"
                          " VALUES ('t1', 'https://b\u00fccher.example/x', :o, 'whk_plain_sql_origin_002', :b)"),
                     {"o": f"https://user:{SECRET}@bücher.example", "b": body_not_json})
    await _run_daemon_once(engine, settings, tmp_path)
    with engine.connect() as conn:
        origins = conn.execute(select(messages.c.origin).order_by(messages.c.id)).scalars().all()
    assert origins == ["https://shop.example.com", "https://xn--bcher-kva.example"]


BAD_CREDENTIALS = ["x" * 32 + "\u00e9", "x" * 32 + "\r\nX-Injected: 1", "with space " + "x" * 32, "x" * 32 + "\x7f"]


@pytest.mark.parametrize("credential", BAD_CREDENTIALS, ids=["non-ascii", "crlf", "space", "del"])
def test_legacy_credentials_must_be_visible_ascii_at_enqueue(engine, settings, credential):
    config = {"url": "https://buyer.example.com/h", "operation_id": "op_1",
              "authentication": {"schemes": ["Bearer"], "credentials": credential}}
    with pytest.raises(OutboxValidationError) as caught, engine.begin() as conn:
        outbox.enqueue_task_webhook(conn, tenant_id="t1", push_notification_config=config, task_id="task_1",
                                    task_type="create_media_buy", status="working", settings=settings)
    assert caught.value.field == "push_notification_config.authentication.credentials"
    with engine.connect() as conn:
        assert conn.execute(select(messages.c.id)).first() is None


async def test_a_stored_credential_that_cannot_be_a_header_ends_dead_invalid_at_once(engine, settings, tmp_path):
    with engine.begin() as conn:
        for scheme, credential in (("Bearer", BAD_CREDENTIALS[1]), ("HMAC-SHA256", BAD_CREDENTIALS[0])):
            config = {"url": "https://buyer.example.com/h", "operation_id": "op_1",
                      "authentication": {"schemes": [scheme], "credentials": "v" * 40}}
            record = outbox.enqueue_task_webhook(conn, tenant_id="t1", push_notification_config=config,
                                                 task_id="task_1", task_type="create_media_buy", status="working",
                                                 settings=settings)
            # What an older release or a plain-SQL producer could have stored.
            sealed = settings.sealing().seal(CREDENTIAL, credential.encode(), tenant_id="t1",
                                             idempotency_key=record.idempotency_key)
            conn.execute(messages.update().where(messages.c.id == record.id).values(auth_secret=sealed))
    await _run_daemon_once(engine, settings, tmp_path)
    with engine.connect() as conn:
        rows = conn.execute(select(messages.c.state, messages.c.dead_reason, messages.c.attempts)).all()
        errors = conn.execute(select(attempts.c.error)).scalars().all()
    assert rows == [("dead", "invalid", 1)] * 2
    assert errors == ["stored legacy credential is not visible ASCII"] * 2


# --- the origin function, differentially: PostgreSQL's trigger against outbox.urls ----------

_LABEL = st.from_regex(r"[A-Za-z0-9]([A-Za-z0-9-]{0,8}[A-Za-z0-9])?", fullmatch=True)
# (host, ordinary): the trigger must compute an ordinary host's origin itself; for the rest
# it may answer NULL (the daemon computes those), but never anything else than Python.
_HOSTS = st.one_of(
    st.lists(_LABEL, min_size=1, max_size=4).map(".".join).flatmap(
        lambda host: st.sampled_from([(host, True), (host + ".", True), (host.upper(), True)])),
    st.integers(0, 2**32 - 1).map(lambda n: (str(ipaddress.IPv4Address(n)), True)),
    st.integers(0, 2**128 - 1).flatmap(lambda n: st.sampled_from([
        (f"[{ipaddress.IPv6Address(n).compressed}]", False),
        (f"[{ipaddress.IPv6Address(n).exploded.upper()}]", False)])),
    st.sampled_from(["b\u00fccher.example", "xn--bcher-kva.example", "EXAMPLE.com..", "a_b.example", "[::1",
                     "-bad.example", "x" * 64 + ".example", "[v1.fe]",
                     "[::ffff:1.2.3.4]", ""]).map(lambda h: (h, False)),
)
_PORTS = st.one_of(st.just(""), st.integers(0, 70_000).map(lambda p: f":{p}"), st.sampled_from(
    [":", ":443", ":80", ":0443", ":00080", ":8x", ":65536", ":99999999"]))
_USERINFO = st.one_of(st.just(""), st.sampled_from(["user@", f"u:{SECRET}@", "a@b@", "%40:x@", "@"]))
_REST = st.text(alphabet="abc/?#%:@!$&'()*+,;=-._~[]XYZ019", max_size=20)


@hsettings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scheme=st.sampled_from(["https", "HTTPS", "http", "Http"]), userinfo=_USERINFO, host=_HOSTS, port=_PORTS,
       rest=_REST)
def test_the_plain_sql_origin_is_the_python_origin(pg_engine, settings, scheme, userinfo, host, port, rest):
    """Whatever writes the row, its origin is ``outbox.urls.origin``'s: the trigger computes
    exactly that, or NULL (left to the daemon) where it cannot; it never keeps userinfo."""
    url = f"{scheme}://{userinfo}{host[0]}{port}/{rest}"
    expected = endpoint_origin(url)
    with pg_engine.begin() as conn:
        computed = conn.execute(text("SELECT outbox_origin(:u)"), {"u": url}).scalar()
        _plain_sql_row(conn, "whk_differential_origin_1", url)
        stored = conn.execute(select(messages.c.origin)).scalar()
        conn.execute(messages.delete())
    assert stored == computed
    if computed is not None:
        assert "@" not in computed and computed == expected, (url, computed, expected)
    if host[1] and expected is not None:
        assert computed == expected, url
    try:  # the producer's path: its origin must survive the trigger unchanged
        with pg_engine.begin() as conn:
            outbox.enqueue(conn, tenant_id="t1", url=url, payload={"e": 1}, settings=settings)
            produced = conn.execute(select(messages.c.url, messages.c.origin)).one()
            conn.execute(messages.delete())
    except OutboxValidationError:
        return
    assert produced.origin == endpoint_origin(produced.url) == expected


@pytest.mark.parametrize(("text_in", "shown"), [
    ("https://u:p@h.example:8443/a?x=1#f", "https://h.example:8443/a"),
    ("2:t134:https://b.example/r?sig=1 then http://x@y/z#q", "2:t134:https://b.example/r then http://y/z"),
    ("no url here?x=1", "no url here?x=1"),
])
def test_redaction_keeps_only_scheme_host_and_path(text_in, shown):
    assert redact_urls(text_in) == shown
    if text_in.startswith("https://"):
        assert public_url(text_in) == shown


@hsettings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(["https://", "x://", "u:p@", "h.example", ":8443", "/p", "?q=1", "#f", "@", "?",
                                  "#", " ", '"', "<", "a", ":", "/"]), max_size=12).map("".join))
def test_redaction_skips_only_texts_it_would_not_change(text_in):
    """The search is skipped for a text without ``@``, ``?`` or ``#``; it never changes what is shown."""
    searched = _URL_IN_TEXT.sub(lambda match: public_url(match.group(0)), text_in)
    assert redact_urls(text_in) == searched


def test_log_lines_lose_every_urls_secrets(capsys):
    """The structlog processor is the second line of defence for any field that embeds a URL."""
    import structlog

    from supervisor.observe.logs import configure_logging

    configure_logging("json")
    try:
        structlog.get_logger("t").warning("x", url=PLAIN_URL, sequence_key=f"2:t1{REPORTING['url']}",
                                          error=f"boom at {PLAIN_URL}", message_id=1)
    finally:
        structlog.reset_defaults()
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert SECRET not in json.dumps(line) and line["message_id"] == 1
    assert line["url"] == "HTTPS://Buyer.Example.COM:443/h" and line["sequence_key"].endswith("/reports")


async def test_an_error_quoting_a_url_is_recorded_without_its_secrets(engine, settings):
    from supervisor.cycle.attempt import Outcome

    with engine.begin() as conn:
        _plain_sql_row(conn, "whk_error_quotes_a_url_1", "https://buyer.example.com/h")
    async_engine = make_async_engine(engine.url.render_as_string(hide_password=False))
    try:
        async with async_engine.begin() as conn:
            (claimed,) = await store.claim(conn, limit=5, lease_seconds=30, horizon_seconds=86_400, daemon_id="u",
                                                  endpoint_concurrency=8)
        completer = Completer(async_engine, settings=settings, daemon_id="u", metrics=Metrics(),
                              fanout=SinkFanout([], timeout=1), outage=OutageGuard(5))
        await completer._flush_until_done([Outcome.dead(claimed, "invalid", f"refused {PLAIN_URL} today")])
    finally:
        await async_engine.dispose()
    with engine.connect() as conn:
        last_error = conn.execute(select(messages.c.last_error)).scalar_one()
        error = conn.execute(select(attempts.c.error)).scalar_one()
    assert last_error == error == "refused HTTPS://Buyer.Example.COM:443/h today"


def test_a_url_filter_matches_only_what_listings_show(engine, capsys, monkeypatch):
    """A filter on the stored URL would let whoever may filter (the console's token) read a
    buyer's query-string secret one character at a time while every listing masks it."""
    enqueue_many(engine, "https://buyer.example.com/hook", ["?token=SECRET1"])
    if engine.dialect.name == "postgresql":  # a plain-SQL row may carry userinfo and a fragment too
        with engine.begin() as conn:
            _plain_sql_row(conn, "whk_plain_sql_userinfo_1", "https://user:PASSWORD1@buyer.example.com/other#FRAG1")
    for needle in ("SECRET1", "token=", "?", "PASSWORD1", "user:", "FRAG1"):
        code, out, _ = cli(capsys, monkeypatch, url_of(engine), "list", "--url", needle, "--json")
        assert code == 0 and json.loads(out) == [], needle
    code, out, _ = cli(capsys, monkeypatch, url_of(engine), "list", "--url", "buyer.example.com/hook", "--json")
    assert [row["url"] for row in json.loads(out)] == ["https://buyer.example.com/hook"]
