"""The console's answers to hostile or mistyped requests, in process, on both databases: each is
the requester's 4xx with its headers, never a 500 or an outage page."""

from __future__ import annotations

import re

import pytest

from outbox.config import load_settings
from supervisor.ui.headers import SECURITY_HEADERS

TOKEN = "t" * 32


@pytest.fixture
def console(engine):
    from starlette.testclient import TestClient

    from supervisor.ui.app import make_app

    settings = load_settings(env={"OUTBOX_DATABASE_URL": engine.url.render_as_string(hide_password=False)})
    with TestClient(make_app(settings, TOKEN), raise_server_exceptions=False) as client:
        signed_in = client.post("/login", data={"token": TOKEN}, follow_redirects=False)
        assert signed_in.status_code == 303
        csrf = re.search(r'name="csrf" value="([^"]+)"', client.get("/jobs").text).group(1)
        yield client, csrf, signed_in


def test_every_answer_carries_the_security_headers(console):
    client, _, signed_in = console
    answers = [signed_in, client.get("/"), client.get("/login"), client.get("/static/console.css"),
               client.get("/no-such-page"), client.post("/", data={}), client.get("/messages?state=bogus")]
    for answer in answers:
        missing = {k: v for k, v in SECURITY_HEADERS.items() if answer.headers.get(k) != v}
        assert not missing, (answer.request.url, answer.status_code, missing)


@pytest.mark.parametrize("path", ["/messages?tenant=%00", "/messages?key=a%00b", "/messages?url=%00", "/?tenant=%00",
                                  "/endpoint?tenant=%00&origin=https://buyer.example", "/messages/a%00b"])
def test_a_nul_in_a_search_is_the_requests_fault_not_an_outage(console, path):
    client, _, _ = console
    answer = client.get(path)
    assert answer.status_code < 500 and "did not answer" not in answer.text, (answer.status_code, answer.text[:300])


@pytest.mark.parametrize("form", [
    {"id": "9223372036854775808"},  # one past BIGINT
    {"tenant": "\x00", "confirm": "no"},
])
def test_a_replay_of_an_impossible_message_is_refused_or_finds_nothing(console, form):
    client, csrf, _ = console
    answer = client.post("/replay", data={"csrf": csrf, **form})
    assert answer.status_code < 500 and "did not answer" not in answer.text, (answer.status_code, answer.text[:300])


@pytest.mark.parametrize("when", ["99999999999999999999999999d", "0001-01-01T00:00+14:00", "9999-12-31T23:59:59-14:00",
                                  "9" * 400])
def test_a_job_from_a_time_no_page_can_print_is_refused_with_a_sentence(console, when):
    client, csrf, _ = console
    for kind, field in (("replay", "since"), ("cancel", "until")):
        answer = client.post("/jobs/start", data={"csrf": csrf, "tenant": "acme", "kind": kind, field: when,
                                                  **({"since": "1h"} if field == "until" else {})})
        assert answer.status_code == 400 and "write a time like" in answer.text, (kind, answer.status_code,
                                                                                   answer.text[:300])


def test_a_session_ends_at_sign_out_or_a_working_day_after_sign_in():
    from supervisor.ui.auth import SESSION_SECONDS, Sessions

    now = [1000.0]
    sessions = Sessions(TOKEN, clock=lambda: now[0])
    assert sessions.sign_in("wrong" * 8) is None
    kept, signed_out = sessions.sign_in(TOKEN), sessions.sign_in(TOKEN)
    csrf = sessions.csrf(kept)
    sessions.sign_out(signed_out)
    now[0] += SESSION_SECONDS - 1
    assert sessions.csrf(signed_out) is None and sessions.csrf_ok(kept, csrf)
    now[0] += 1
    assert sessions.csrf(kept) is None and not sessions.csrf_ok(kept, csrf)
    assert SESSION_SECONDS == 12 * 3600


@pytest.mark.parametrize("base, secure", [("https://console.example", True), ("http://127.0.0.1", False)])
def test_the_session_cookie_is_secure_whenever_the_browser_came_over_tls(engine, base, secure):
    from starlette.testclient import TestClient

    from supervisor.ui.app import make_app

    settings = load_settings(env={"OUTBOX_DATABASE_URL": engine.url.render_as_string(hide_password=False)})
    with TestClient(make_app(settings, TOKEN), base_url=base) as client:
        cookie = client.post("/login", data={"token": TOKEN}, follow_redirects=False).headers["set-cookie"]
    attributes = {part.strip().lower() for part in cookie.split(";")}
    assert {"httponly", "samesite=strict"} <= attributes and ("secure" in attributes) is secure, cookie


def test_an_action_without_a_session_is_refused_before_its_form_is_read(engine):
    from starlette.testclient import TestClient

    from supervisor.ui.app import make_app

    settings = load_settings(env={"OUTBOX_DATABASE_URL": engine.url.render_as_string(hide_password=False)})
    read = []

    def body():  # the request body, noting whether anyone read it
        read.append(True)
        yield b"csrf=x&id=1"

    with TestClient(make_app(settings, TOKEN)) as client:
        answer = client.post("/replay", content=body(),
                             headers={"content-type": "application/x-www-form-urlencoded"})
    assert answer.status_code == 401 and not read


async def test_a_confirmation_acts_once_however_often_and_however_soon_it_is_posted_again():
    """Every post of one confirmation gets the first's outcome, a post arriving while the first
    still acts included (it waits); an act that raised (it changed nothing) may be posted again."""
    import asyncio
    from supervisor.ui.once import KEPT, Confirmations
    confirmations, acted = Confirmations(), []

    async def act() -> str:
        acted.append(1)
        await asyncio.sleep(0.05)
        return f"done {len(acted)}"

    token = confirmations.issue()
    assert confirmations.known(token) and not confirmations.known("never-issued")
    outcomes = await asyncio.gather(*(confirmations.act_once(token, act) for _ in range(3)))
    assert outcomes == ["done 1"] * 3 and len(acted) == 1 and confirmations.outcome(token) == "done 1"
    assert await confirmations.act_once(token, act) == "done 1" and len(acted) == 1

    async def fails() -> str:
        raise ConnectionError("the database went away before anything changed")

    failing = confirmations.issue()
    for _ in range(2):
        try:
            await confirmations.act_once(failing, fails)
        except ConnectionError:
            pass
    assert confirmations.outcome(failing) is None
    assert await confirmations.act_once(failing, act) == "done 2"
    for _ in range(KEPT):
        confirmations.issue()
    assert not confirmations.known(token)  # the oldest are forgotten past KEPT


async def test_the_overview_lists_an_endpoint_whose_every_message_died(engine, console):
    """Known by neither a breaker row nor a backlog (its messages died at once: 410), an
    endpoint with attempts in the last hour is listed with them, as `outboxd endpoints` does."""
    from outbox.db import make_async_engine
    from outbox.store import db_now
    from supervisor.observe import health_stats
    from supervisor.observe.health_stats import Recorded
    client, _, _ = console
    async_engine = make_async_engine(engine.url.render_as_string(hide_password=False))
    try:
        async with async_engine.begin() as conn:
            gone = [Recorded.of("t\u00ebnant", "https://gone.example", "gone", 30, True) for _ in range(2)]
            await health_stats.record(conn, health_stats.tally(gone, now=await db_now(conn), daemon_id="d"))
    finally:
        await async_engine.dispose()
    page = client.get("/").text
    assert "https://gone.example" in page and "No endpoint has been sent to yet" not in page


def test_a_replay_by_a_key_several_tenants_use_is_refused_in_the_console(engine, console):
    from sqlalchemy import text

    from tests.ledger import enqueue_many
    client, csrf, _ = console
    enqueue_many(engine, "https://buyer.example/hook", ["", ""], tenants=2)
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox_messages SET idempotency_key = 'whk_shared_0001', state = 'dead', "
                          "dead_reason = 'gone', finished_at = 1.0, retry_until = 9e9"))
    dry = client.post("/replay", data={"csrf": csrf, "key": "whk_shared_0001"})
    assert dry.status_code == 400 and "Several tenants use that idempotency key" in dry.text
    one = client.post("/replay", data={"csrf": csrf, "key": "whk_shared_0001", "tenant": "tenant-1"})
    assert one.status_code == 200 and re.findall(r'name="id" value="(\d+)"', one.text) == ["2"]
