"""``outboxd ui`` as an operator meets it: the real console process, the real daemon, a real
receiver on 127.0.0.1, and Debian's chromium driven by Selenium (never a downloaded browser).

Screenshots (1400×1000) are saved in the tests' temporary directories, and also copied to
``$CONSOLE_SHOTS_DIR`` when that is set.
"""

from __future__ import annotations

import math
import re
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

import outbox
from outbox.schema import attempts, jobs, messages
from tests import procs
from tests.console_driver import (TOKEN, bucket_bounds, chromium, console_env, keep_shots, needs_chromium, sign_in,
                                  signed_in, submit, tile)
from tests.console_driver import console  # noqa: F401 - a pytest fixture
from tests.ledger import enqueue_many, finished

pytestmark = pytest.mark.e2e
def replay_state(engine, message_id: int) -> tuple[str, str]:
    with engine.connect() as conn:
        row = conn.execute(select(messages.c.state, messages.c.trigger).where(messages.c.id == message_id)).one()
    return row.state, row.trigger


def test_actions_need_the_token_and_the_csrf_token(pg_engine, console):
    enqueue_many(pg_engine, "http://127.0.0.1:9", ["/hook"])
    with pg_engine.begin() as conn:
        conn.execute(messages.update().values(state="dead", dead_reason="gone", finished_at=1.0, retry_until=9e9))
    anonymous = httpx.Client(base_url=console)
    assert anonymous.get("/messages").status_code == 303  # every page: sign in first
    assert anonymous.post("/login", data={"token": "wrong"}).status_code == 401
    refused = anonymous.post("/replay", data={"id": "1", "confirm": "yes"})
    assert refused.status_code == 401
    assert anonymous.post("/breakers/reset", data={"tenant": "t", "origin": "http://x"}).status_code == 401
    client, csrf = signed_in(console)
    for bad in ({}, {"csrf": "forged"}):
        assert client.post("/replay", data={"id": "1", "confirm": "yes", **bad}).status_code == 403
        assert client.post("/breakers/reset", data={"tenant": "t", "origin": "http://x", **bad}).status_code == 403
    assert replay_state(pg_engine, 1) == ("dead", "scheduled")  # nothing refused took effect
    dry = client.post("/replay", data={"id": "1", "csrf": csrf})
    assert dry.status_code == 200 and "1 message(s) would be replayed" in dry.text
    assert replay_state(pg_engine, 1) == ("dead", "scheduled")  # a dry run changes nothing
    assert client.post("/replay", data={"id": "1", "csrf": csrf, "confirm": "yes"}).status_code == 400  # no token
    once = re.search(r'name="once" value="([^"]+)"', dry.text).group(1)
    confirm = {"id": "1", "csrf": csrf, "confirm": "yes", "once": once}
    done = client.post("/replay", data=confirm)
    assert done.status_code == 303  # then a page that only reads: a reload replays nothing
    assert "Replayed 1 message(s)" in client.get(done.headers["location"]).text
    assert replay_state(pg_engine, 1) == ("pending", "replay")
    with pg_engine.begin() as conn:  # a daemon delivered the replay; a delivered message may be replayed again
        conn.execute(messages.update().values(state="delivered", finished_at=2.0))
    again = client.post("/replay", data=confirm)  # the same confirmation posted again (double click, back button)
    assert "Replayed 1 message(s)" in client.get(again.headers["location"]).text
    assert replay_state(pg_engine, 1) == ("delivered", "replay")  # shown what the first did, not done twice
    assert client.post("/replay", data={"id": "abc", "tenant": "t", "csrf": csrf}).status_code == 400


def test_filtered_replay_counts_first_and_caps_at_its_limit(pg_engine, console):
    enqueue_many(pg_engine, "http://127.0.0.1:9", ["/a", "/b", "/c"])
    with pg_engine.begin() as conn:
        conn.execute(messages.update().values(state="dead", dead_reason="rejected", finished_at=1.0,
                                              retry_until=9e9))
    client, csrf = signed_in(console)
    assert len(re.findall(r'href="/messages/\d+"', client.get("/messages?since=1h&reason=rejected").text)) == 3
    assert 'href="/messages/' not in client.get("/messages?until=1h").text  # all created within the hour
    bad = client.get("/messages?since=soonish")
    assert bad.status_code == 400 and "Since:" in bad.text
    assert client.post("/replay", data={"csrf": csrf}).status_code == 400  # no filter: refused, not "all"
    dry = client.post("/replay", data={"csrf": csrf, "reason": "rejected", "limit": "2"})
    assert "2 message(s) would be replayed" in dry.text and "1 more matched" in dry.text
    confirm_ids = re.findall(r'name="id" value="(\d+)"', dry.text)
    assert confirm_ids == ["1", "2"]  # the confirmation replays exactly what the dry run counted


def test_an_endpoints_links_and_searches_match_that_endpoint_and_that_tenant_exactly(pg_engine, console):
    """An origin is no substring of another (``:2808`` of ``:28081``) and a tenant id is no
    other spelling of one (``acme `` is not ``acme``): the endpoint page's links, the search
    and "Replay matching" select exactly its messages."""
    enqueue_many(pg_engine, "http://127.0.0.1:2808", ["/a", "/b"])
    enqueue_many(pg_engine, "http://127.0.0.1:28081", ["/c"])
    with pg_engine.begin() as conn:
        conn.execute(messages.update().values(state="dead", dead_reason="gone", finished_at=1.0, retry_until=9e9))
        conn.execute(messages.update().where(messages.c.id == 2).values(tenant_id="tenant-0 "))
    client, csrf = signed_in(console)
    page = client.get("/endpoint", params={"tenant": "tenant-0", "origin": "http://127.0.0.1:2808"}).text
    links = re.findall(r'href="(/messages\?[^"]*origin=[^"]*)"', page)
    assert links and all("url=" not in link for link in links)
    dead = client.get(next(link for link in links if "state=dead" in link).replace("&amp;", "&")).text
    assert re.findall(r'href="/messages/(\d+)"', dead) == ["1"]
    for tenant, expected in (("tenant-0", ["1", "3"]), ("tenant-0 ", ["2"])):
        found = client.get("/messages", params={"tenant": tenant, "state": "dead"}).text
        assert sorted(re.findall(r'href="/messages/(\d+)"', found)) == expected, tenant
    dry = client.post("/replay", data={"csrf": csrf, "tenant": "tenant-0", "origin": "http://127.0.0.1:2808/any"})
    assert re.findall(r'name="id" value="(\d+)"', dry.text) == ["1"]


@needs_chromium
def test_dead_message_found_by_search_and_replayed_from_the_browser(pg_engine, pg_url, tmp_path, console):
    from selenium.webdriver.common.by import By

    key, jwks = procs.make_key(tmp_path)
    with procs.receiver(tmp_path, jwks, verifier="library") as (port, log):
        enqueue_many(pg_engine, f"http://127.0.0.1:{port}", ["/ok"])  # another message, not to be touched
        [k] = enqueue_many(pg_engine, f"http://127.0.0.1:{port}", ["/flaky/1/410"])
        daemon = procs.start_daemon(procs.daemon_env(pg_url, key), tmp_path / "d.log")
        try:
            with chromium() as browser:
                assert procs.wait_until(lambda: finished(pg_engine, 2), 30)
                browser.get(f"{console}/messages")
                assert browser.current_url.endswith("/login")
                browser.find_element(By.ID, "token").send_keys(TOKEN)
                browser.find_element(By.ID, "sign-in").click()
                assert "Gone" in browser.find_element(By.ID, "dead").text
                browser.get(f"{console}/messages")
                browser.find_element(By.ID, "tenant").send_keys("tenant-0")
                browser.find_element(By.ID, "key").send_keys(k)
                submit(browser, By.ID, "search-button")
                assert procs.wait_until(lambda: "key=" in browser.current_url, 15)  # the results page, not the form's
                rows = browser.find_elements(By.CSS_SELECTOR, "#results tr")[1:]
                assert len(rows) == 1 and "Dead: Gone" in rows[0].text and k in rows[0].text
                rows[0].find_element(By.TAG_NAME, "a").click()
                payload = browser.find_element(By.ID, "payload").text
                assert "[redacted]" in payload and "e2e-token" not in browser.page_source
                assert "410" in browser.find_element(By.ID, "attempts").text
                submit(browser, By.ID, "replay-button")
                assert "1 message(s) would be replayed" in browser.find_element(By.ID, "dry-run-count").text
                submit(browser, By.ID, "confirm-button")
                assert "Replayed 1 message(s)" in browser.find_element(By.ID, "replayed-count").text
                replays = lambda: [a for a in procs.arrivals(log) if a["key"] == k]  # noqa: E731
                assert procs.wait_until(lambda: len(replays()) == 2 and finished(pg_engine, 2), 30)
        finally:
            procs.stop(daemon)
    first, second = replays()
    assert first["sha256"] == second["sha256"] and (first["status"], second["status"]) == (410, 200)
    assert second["verified"]
    assert len(procs.arrivals(log)) == 3  # the other message was not replayed


def endpoint_truth(engine, origin: str) -> dict[str, Any]:
    """An endpoint's attempts, successes, deaths and response times, counted from its rows."""
    with engine.connect() as conn:
        rows = conn.execute(select(attempts.c.outcome, attempts.c.response_time_ms)
                            .where(attempts.c.url.startswith(origin + "/"))).all()
        deaths = conn.execute(select(func.count()).select_from(messages).where(messages.c.state == "dead")).scalar_one()
    return {"attempts": len(rows), "successes": sum(r.outcome == "success" for r in rows), "deaths": deaths,
            "timed": sorted(r.response_time_ms for r in rows if r.response_time_ms is not None)}


def job_row(engine) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(jobs)).one()


@needs_chromium
def test_endpoint_health_and_a_recovery_job_in_the_browser(pg_engine, pg_url, tmp_path, console):
    """The daemon delivers to a real receiver; the endpoint page shows what its attempt rows
    say, and a recovery job started, paused and resumed in the browser shows the job row's
    progress, then replays every dead message exactly once."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    key, jwks = procs.make_key(tmp_path)
    shots: list[Path] = []
    with procs.receiver(tmp_path, jwks, verifier="library") as (port, log):
        origin = f"http://127.0.0.1:{port}"
        paths = [p for i in range(8) for p in (f"/flaky/1/410?i={i}", "/ok", "/delay/40")][:20]  # 7 die, 13 arrive
        keys = enqueue_many(pg_engine, origin, paths)
        doomed = {k for k, p in zip(keys, paths) if p.startswith("/flaky")}
        daemon = procs.start_daemon(procs.daemon_env(pg_url, key), tmp_path / "d.log")
        try:
            with chromium(screen=True) as browser:
                assert procs.wait_until(lambda: finished(pg_engine, len(paths)), 60)
                truth = endpoint_truth(pg_engine, origin)
                assert truth["deaths"] == len(doomed) and truth["attempts"] == len(paths)
                sign_in(browser, console)
                browser.get(f"{console}/endpoint?tenant=tenant-0&origin={origin}")
                page = browser.page_source
                assert int(tile(page, "attempts")) == truth["attempts"] and int(tile(page, "deaths")) == truth["deaths"]
                assert float(tile(page, "success-rate")) == pytest.approx(
                    truth["successes"] / truth["attempts"], abs=1e-4)
                assert tile(page, "breaker") == "closed"
                for name, rank in (("p50", 0.5), ("p95", 0.95)):  # the histogram's estimate, in the true value's bucket
                    true_value = truth["timed"][math.ceil(rank * len(truth["timed"])) - 1]  # nearest rank
                    low, high = bucket_bounds(true_value)
                    assert low <= float(tile(page, name)) <= high, (name, true_value, truth["timed"])
                shown = browser.find_element(By.ID, "endpoint-health").text.lower()  # the tiles' labels are upper-cased
                assert f"success rate\n{100 * truth['successes'] / truth['attempts']:.1f} %" in shown
                shots.append(tmp_path / "console-endpoint-health.png")
                assert browser.get_screenshot_as_file(str(shots[-1]))

                browser.get(f"{console}/jobs")
                browser.find_element(By.ID, "job-tenant").send_keys("tenant-0")
                browser.find_element(By.ID, "job-since").send_keys("1h")
                Select(browser.find_element(By.ID, "job-reason")).select_by_value("gone")
                rate = browser.find_element(By.ID, "job-rate")
                rate.clear()
                rate.send_keys("1")
                submit(browser, By.ID, "count-job-button")
                counted = browser.find_element(By.ID, "job-dry-run-count").text
                assert counted.startswith(f"{len(doomed)} dead message(s) match now")
                with pg_engine.connect() as conn:
                    assert conn.execute(select(func.count()).select_from(jobs)).scalar_one() == 0  # counted only
                submit(browser, By.ID, "confirm-job-button")
                assert "Recovery job started" in browser.find_element(By.ID, "notice").text
                assert procs.wait_until(lambda: job_row(pg_engine).done >= 2, 30)
                submit(browser, By.ID, "pause-button")
                assert "Job paused" in browser.find_element(By.ID, "notice").text
                paused = job_row(pg_engine)
                count = browser.find_element(By.CSS_SELECTOR, "#job .job-count")
                assert paused.state == "paused" and 2 <= paused.done < paused.total == len(doomed)
                assert (int(count.get_attribute("data-done")), int(count.get_attribute("data-total"))) == \
                    (paused.done, paused.total)
                assert browser.find_element(By.ID, "job-state").get_attribute("data-value") == "paused"
                assert int(browser.find_element(By.ID, "job-remaining").get_attribute("data-value")) == \
                    paused.total - paused.done - paused.skipped
                shots.append(tmp_path / "console-job.png")
                assert browser.get_screenshot_as_file(str(shots[-1]))
                browser.get(f"{console}/jobs")
                listed = browser.find_element(By.CSS_SELECTOR, f"#job-{paused.id} .job-count")
                assert listed.text == f"{paused.done} / {paused.total}" and "Paused" in \
                    browser.find_element(By.ID, f"job-{paused.id}").text
                shots.append(tmp_path / "console-jobs.png")
                assert browser.get_screenshot_as_file(str(shots[-1]))
                submit(browser, By.LINK_TEXT, str(paused.id))
                submit(browser, By.ID, "resume-button")
                assert "Job resumed" in browser.find_element(By.ID, "notice").text
                assert procs.wait_until(lambda: job_row(pg_engine).state == "done", 60)
                arrived = lambda: [a["key"] for a in procs.arrivals(log)]  # noqa: E731
                assert procs.wait_until(lambda: finished(pg_engine, len(paths))
                                        and sum(arrived().count(k) for k in doomed) == 2 * len(doomed), 30)
        finally:
            procs.stop(daemon)
    done = job_row(pg_engine)
    assert (done.done, done.skipped, done.total) == (len(doomed), 0, len(doomed))
    assert all(arrived().count(k) == 2 for k in doomed)  # each dead message replayed exactly once
    assert all(arrived().count(k) == 1 for k in keys if k not in doomed)  # nothing else replayed
    keep_shots(shots)


async def test_subscribers_are_shown_and_masked(sqlite_engine, settings):
    from outbox.config import with_overrides
    from outbox.db import make_async_engine
    from supervisor.ui.registry import subscribers

    url = sqlite_engine.url.render_as_string(hide_password=False)
    engine = make_async_engine(url)
    entry = {"subscriber_id": "s1", "url": "http://127.0.0.1:9/h?sig=SENTINEL", "event_types": ["creative.purged"],
             "authentication": {"schemes": ["Bearer"], "credentials": "SENTINEL" * 5}}
    try:
        assert await subscribers(engine) == []  # the registry exists, empty
        with sqlite_engine.begin() as conn:
            outbox.register_subscriber(conn, tenant_id="acme", account_id="a1", notification_config=entry,
                                       settings=with_overrides(settings, seller_agent_url="https://s.example"))
        [row] = await subscribers(engine)
    finally:
        await engine.dispose()
    assert row["url"] == "http://127.0.0.1:9/h" and row["auth_secret"] == "[redacted]"
    assert "SENTINEL" not in repr(row)


def test_without_a_configured_token_one_is_generated_and_printed(pg_url, tmp_path):
    port = procs.free_port()
    proc = procs.start_ui(console_env(pg_url), port, tmp_path / "ui.log")
    try:
        printed = (tmp_path / "ui.log").read_text()
        match = re.search(rf"http://127\.0\.0\.1:{port}/ \(sign in with token (\S+)\)", printed)
        assert match, printed
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}")
        assert client.post("/login", data={"token": match.group(1)}).status_code == 303
        assert client.get("/").status_code == 200
    finally:
        procs.stop(proc)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_ends_the_console_gracefully_with_status_0(pg_url, tmp_path, sig):
    """Kubernetes and systemd read a non-zero status after their own SIGTERM as a failed stop.
    Sent as soon as the port accepts (the console binds it before it starts serving) and again
    once a page has answered: both stop it."""
    port = procs.free_port()
    proc = procs.start_ui(console_env(pg_url), port, tmp_path / "ui.log")
    assert procs.stop(proc, sig) == 0, (tmp_path / "ui.log").read_text()[-500:]
    proc = procs.start_ui(console_env(pg_url), port, tmp_path / "ui.log")

    def answers() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/login", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    assert procs.wait_until(answers, 30)
    assert procs.stop(proc, sig) == 0, (tmp_path / "ui.log").read_text()[-500:]


_SIGNAL_IN_A_WEAKREF_CALLBACK = """
import os, signal, sys, time, weakref
from supervisor.ui.server import _stop_signals_end_quietly

_stop_signals_end_quietly()

class Thing:
    pass

def callback(_ref):  # where Python prints and ignores an exception: a weakref callback
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)

thing = Thing()
ref = weakref.ref(thing, callback)
del thing
print("the stop was swallowed", flush=True)
sys.exit(1)
"""


def test_a_stop_signal_landing_in_a_weakref_callback_still_ends_the_console():
    """The stop handlers end the process at once: a SystemExit raised by a handler inside a
    weakref callback (SQLAlchemy's and the standard library's run while the console starts)
    was printed and ignored, and the console went on to serve."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _SIGNAL_IN_A_WEAKREF_CALLBACK], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout) == (0, ""), done.stdout + done.stderr
