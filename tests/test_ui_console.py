"""The console's pages against a known history: the browser sees the database's numbers in the
health strip and the charts, and every page answers bad input and forged words safely.

Screenshots of the overview, an endpoint and a message are kept as tests/test_ui.py keeps its own.
"""

from __future__ import annotations

import re
import subprocess
import sys
from html import unescape
from urllib.parse import urlencode

import httpx
import pytest
from sqlalchemy import func, select

from outbox.schema import breakers, messages
from tests import procs
from tests.console_history import DUE_AGO, OPEN_ENDPOINT, QUIET_TO, attempt_rows, seed, tally
from tests.console_driver import (chromium, console, console_env,  # noqa: F401 (fixture)
                                  keep_shots, needs_chromium, sign_in, signed_in)

pytestmark = pytest.mark.e2e
BUCKET = re.compile(r'<g class="bucket" data-start="(\d+)" data-delivered="(\d+)" data-failed="(\d+)">')
LATENCY = re.compile(r'<g class="bucket" data-start="(\d+)" data-latency-avg="([\d.]+)"')
SHOTS = {"overview": "/", "endpoint": "/endpoint?" + urlencode(dict(zip(("tenant", "origin"), OPEN_ENDPOINT)))}


def health_values(page: str) -> dict[str, str]:
    """The health strip's tiles: id to the number the page carries."""
    return dict(re.findall(r'<div class="tile[^"]*" id="health-([a-z-]+)"><div class="k">[^<]*</div>\s*'
                           r'<div class="v" data-value="([^"]*)"', page))


def charts_of(page: str, name: str) -> str:
    """The markup of one window's charts (``hour`` or ``day``)."""
    start = page.index(f'id="charts-{name}"')
    return page[start:page.index('<div class="grid2"', start + 1) if name == "hour" else len(page)]


def check_charts(page: str, rows: list, tenant: str | None = None, origin: str | None = None) -> int:
    """Every bucket of both windows holds what the attempt rows say; the attempts charted."""
    charted = 0
    for name, width in (("hour", 60), ("day", 3600)):
        markup = charts_of(page, name)
        buckets = BUCKET.findall(markup)
        assert len(buckets) == (60 if name == "hour" else 24)
        for start, delivered, failed in buckets:
            expected = tally(rows, float(start), float(start) + width, tenant, origin)
            assert (int(delivered), int(failed)) == (expected.delivered, expected.failed), (name, start)
            charted += int(delivered) + int(failed)
        for start, avg in LATENCY.findall(markup):
            assert float(avg) == pytest.approx(tally(rows, float(start), float(start) + width, tenant, origin)
                                               .latency_avg_ms, abs=0.06)  # drawn to 0.1 ms
        totals = re.search(rf'id="{name}-delivered">([\d,]+)</span>.*?id="{name}-failed">([\d,]+)<', markup, re.S)
        assert [int(t.replace(",", "")) for t in totals.groups()] == [
            sum(int(b[1]) for b in buckets), sum(int(b[2]) for b in buckets)]
    return charted


def test_health_strip_and_charts_carry_the_database_numbers(pg_engine, console, tmp_path):
    history = seed(pg_engine, tmp_path)
    rows = attempt_rows(pg_engine)
    client, _ = signed_in(console)
    page = client.get("/").text
    with pg_engine.connect() as conn:
        backlog = conn.execute(select(func.count()).select_from(messages)
                               .where(messages.c.state.in_(("pending", "in_flight")))).scalar_one()
        oldest = conn.execute(select(func.min(messages.c.next_attempt_at))
                              .where(messages.c.state == "pending")).scalar()
        open_breakers = conn.execute(select(func.count()).select_from(breakers)
                                     .where(breakers.c.state != "closed")).scalar_one()
    recent = tally(rows, history.now - QUIET_TO, history.now + 3600)
    strip = health_values(page)
    assert int(strip["backlog"]) == backlog > 0
    assert (history.now - oldest <= float(strip["oldest-due"]) <= history.now - oldest + 90
            and oldest < history.now - DUE_AGO)
    # The five whole minutes before the current one and the current one so far: 300 to 360 s.
    assert recent.delivered * 60 / 360 - 0.05 <= float(strip["delivery-rate"]) <= recent.delivered * 60 / 300 + 0.05
    assert recent.delivered > 0
    assert strip["failure-rate"] == f"{recent.failed / (recent.delivered + recent.failed):.3f}" and recent.failed > 0
    assert int(strip["breakers"]) == open_breakers == 1
    assert f'id="daemons" data-value="{recent.daemons}"' in page and recent.daemons > 0
    assert strip["keys"] == "1" and "1 next" in page
    assert check_charts(page, rows) > 0
    assert check_charts(client.get("/?tenant=acme").text, rows, tenant="acme") > 0
    endpoint = client.get(SHOTS["endpoint"]).text
    assert check_charts(endpoint, rows, *OPEN_ENDPOINT) > 0
    assert int(health_values(endpoint)["breakers"]) == 1
    failures = re.findall(r'<td class="num">(\d+|–)</td>\s*<td class="num">', endpoint.split('id="failures"')[1])
    assert failures and set(failures) <= {"503", "500", "410", "–"}  # the failed attempts' statuses


@needs_chromium
def test_screenshots_of_the_overview_an_endpoint_and_a_message(pg_engine, console, tmp_path):
    from selenium.webdriver.common.by import By

    history = seed(pg_engine, tmp_path)
    rows = attempt_rows(pg_engine)
    shots = {}
    with chromium(screen=True) as browser:
        sign_in(browser, console)
        for name, path in {**SHOTS, "message": f"/messages/{history.featured}"}.items():
            browser.get(console + path)
            browser.find_element(By.CSS_SELECTOR, "main h1")
            shots[name] = tmp_path / f"console-{name}.png"
            assert browser.get_screenshot_as_file(str(shots[name]))
            if name == "overview":
                assert check_charts(browser.page_source, rows) > 0
                assert int(health_values(browser.page_source)["backlog"]) == history.pending
                tip = browser.find_element(By.CSS_SELECTOR, "#charts-hour svg.throughput g.bucket title")
                assert re.fullmatch(r"\d\d:\d\d–\d\d:\d\d UTC: \d+ delivered, \d+ failed",
                                    tip.get_attribute("textContent"))
            if name == "message":
                trail = browser.find_element(By.ID, "attempts").text
                assert trail.count("Failed 503") == 2 and "Timeout" in trail and "Success 200" in trail
                assert "query-secret" not in browser.page_source
                moment = browser.find_element(By.CSS_SELECTOR, "#attempts time")
                assert moment.text.endswith("ago") and re.fullmatch(r"\d{4}-.*Z", moment.get_attribute("title"))
        browser.find_element(By.ID, "replay-button").click()
        assert str(history.featured) in browser.find_element(By.ID, "replay-list").text
    keep_shots(list(shots.values()))


def test_breaker_reset_asks_first_and_notices_are_fixed_words(pg_engine, console, tmp_path):
    seed(pg_engine, tmp_path, per_endpoint=3)
    client, csrf = signed_in(console)
    forged = client.get("/", params={"notice": "<b>all good</b> trust me"})
    assert "trust me" not in forged.text and 'id="notice"' not in forged.text
    form = {"csrf": csrf, "tenant": OPEN_ENDPOINT[0], "origin": OPEN_ENDPOINT[1]}
    ask = client.post("/breakers/reset", data=form)
    assert ask.status_code == 200 and 'id="confirm-reset-button"' in ask.text and "7 failures in a row" in ask.text
    assert open_breakers(pg_engine) == 1  # asking changed nothing
    done = client.post("/breakers/reset", data={**form, "confirm": "yes"})
    assert done.status_code == 303 and open_breakers(pg_engine) == 0
    landed = client.get(done.headers["location"])
    assert "Breaker reset: the endpoint takes deliveries again at once." in landed.text
    again = client.get(client.post("/breakers/reset", data={**form, "confirm": "yes"}).headers["location"])
    assert "There was no breaker to reset" in again.text


def open_breakers(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(breakers).where(breakers.c.state == "open")).scalar_one()


def test_pages_walk_every_message_and_the_dry_run_lists_them(pg_engine, console, tmp_path):
    seed(pg_engine, tmp_path, per_endpoint=45)
    with pg_engine.connect() as conn:
        every = set(conn.execute(select(messages.c.id)).scalars())
        dead = sorted(conn.execute(select(messages.c.id).where(messages.c.state == "dead")).scalars())
    client, csrf = signed_in(console)
    seen, url, pages = [], "/messages", 0
    while url:
        page = client.get(url).text
        seen += [int(i) for i in re.findall(r'<td class="num"><a href="/messages/(\d+)">', page)]
        older = re.search(r'<a href="([^"]+)" id="older">', page)
        url, pages = (unescape(older.group(1)) if older else None), pages + 1
    assert sorted(seen) == sorted(every) and len(every) > 120 and pages == -(-len(every) // 50)
    assert f"{len(every):,} messages match" in client.get("/messages").text
    dry = client.post("/replay", data={"csrf": csrf, "state": "dead", "reason": "gone"})
    listed = [int(i) for i in re.findall(r'<td class="num"><a href="/messages/(\d+)">',
                                         dry.text.split("replay-list")[1])]
    confirming = [int(i) for i in re.findall(r'name="id" value="(\d+)"', dry.text)]
    words = re.search(r"Refused \d+ message\(s\), past its retry horizon: ([\d, ]+)\.", dry.text)
    refused = [int(i) for i in words.group(1).split(", ")]
    assert listed == confirming and sorted(listed + refused) == dead and listed and refused
    assert f"{len(listed)} message(s) would be replayed" in dry.text


@pytest.mark.parametrize("field, value, words", [
    ("limit", "abc", "“at most” must be a whole number from 1 to 10,000."),
    ("limit", "0", "“at most” must be a whole number from 1 to 10,000."),
    ("since", "soonish", "Since: write a time like"),
    ("state", "exploded", "State must be one of: Pending, In flight, Delivered, Dead."),
])
def test_typed_mistakes_get_a_sentence(pg_engine, console, field, value, words):
    client, csrf = signed_in(console)
    answer = client.post("/replay", data={"csrf": csrf, "tenant": "acme", field: value})
    assert answer.status_code == 400 and words in unescape(answer.text)
    assert "invalid literal" not in answer.text and "Traceback" not in answer.text
    assert client.get("/messages", params={"before": "x"}).status_code == 400
    for ref in ("¹", "9" * 25, "no-such-key"):
        assert client.get(f"/messages/{ref}").status_code == 404


def test_refresh_pauses(pg_engine, console):
    client, _ = signed_in(console)
    page = client.get("/?tenant=acme").text
    assert '<meta http-equiv="refresh" content="15">' in page
    assert '<a href="/?tenant=acme&amp;refresh=off" id="pause">' in page  # relative: right behind a proxy
    paused = client.get("/?tenant=acme&refresh=off").text
    assert "http-equiv" not in paused and '<a href="/?tenant=acme" id="resume">' in paused


@pytest.mark.parametrize("token", ["short-token", "x" * 31])
def test_a_short_token_is_refused_off_loopback(pg_url, tmp_path, token):
    env = {**console_env(pg_url), "OUTBOX_UI_TOKEN": token, "OUTBOX_UI_ADDR": f"0.0.0.0:{procs.free_port()}"}
    done = subprocess.run([sys.executable, "-m", "supervisor.cli", "ui"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "needs at least 32" in done.stderr


def test_an_address_the_console_cannot_listen_on_is_one_line_before_any_token(pg_url, tmp_path):
    import socket
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        env = {**console_env(pg_url), "OUTBOX_UI_ADDR": f"127.0.0.1:{taken.getsockname()[1]}"}
        env.pop("OUTBOX_UI_TOKEN", None)
        done = subprocess.run([sys.executable, "-m", "supervisor.cli", "ui"], env=env, capture_output=True,
                              text=True, timeout=60)
    finally:
        taken.close()
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "OUTBOX_UI_ADDR 127.0.0.1:" in done.stderr and "cannot listen there" in done.stderr
    assert "sign in with token" not in done.stderr


def test_a_short_token_is_fine_on_loopback(pg_url, tmp_path):
    port = procs.free_port()
    proc = procs.start_ui({**console_env(pg_url), "OUTBOX_UI_TOKEN": "short"}, port, tmp_path / "ui.log")
    try:
        assert httpx.post(f"http://127.0.0.1:{port}/login", data={"token": "short"}).status_code == 303
    finally:
        procs.stop(proc)
