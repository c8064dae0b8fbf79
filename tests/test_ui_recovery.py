"""The console's endpoint health and recovery jobs in process, on both databases: the numbers
shown are the rollup's and the job rows', every action is counted or asked first, and every
typed mistake gets a sentence."""

from __future__ import annotations

import re
import statistics
from html import unescape

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from sqlalchemy import delete, func, select

from outbox.config import load_settings
from outbox.db import make_async_engine
from outbox.schema import endpoint_stats, jobs, messages
from supervisor.observe import health_stats
from supervisor.operator.ops import row_id
from supervisor.ui.forms import JOB_RATE_MAX, BadInput, job_rate, job_selection
from tests.console_history import ENDPOINTS, OPEN_ENDPOINT, seed
from tests.console_driver import bucket_bounds, tile

TOKEN = "t" * 32
# What the daemons recorded for the open endpoint in the current minute: (2xx?, latency ms, died?).
RECORDED = [(True, 40, False), (True, 55, False), (False, 700, False), (False, 900, True), (True, 60, False),
            (False, None, True), (False, 3000, False), (True, 45, False)]


@pytest.fixture
def console(engine, tmp_path):
    from starlette.testclient import TestClient

    from supervisor.ui.app import make_app

    history = seed(engine, tmp_path, per_endpoint=10)
    settings = load_settings(env={"OUTBOX_DATABASE_URL": engine.url.render_as_string(hide_password=False)})
    with TestClient(make_app(settings, TOKEN)) as client:
        assert client.post("/login", data={"token": TOKEN}, follow_redirects=False).status_code == 303
        csrf = re.search(r'name="csrf" value="([^"]+)"', client.get("/jobs").text).group(1)
        yield client, csrf, history


async def record(engine, now: float) -> None:
    aengine = make_async_engine(engine.url.render_as_string(hide_password=False))
    try:
        async with aengine.begin() as conn:
            await conn.execute(delete(endpoint_stats))  # only these counts: not the seeded history's
            await health_stats.record(conn, health_stats.tally(
                [*(health_stats.Recorded(*OPEN_ENDPOINT, True, ok, ms, died) for ok, ms, died in RECORDED),
                 *(health_stats.Recorded(*ENDPOINTS[1], True, True, 20, False) for _ in range(3))],
                now=now, daemon_id="outboxd-test"))
    finally:
        await aengine.dispose()


async def test_endpoint_health_shows_what_the_daemons_recorded(engine, console):
    client, _, history = console
    await record(engine, history.now)
    tenant, origin = OPEN_ENDPOINT
    page = client.get("/endpoint", params={"tenant": tenant, "origin": origin}).text
    successes = sum(ok for ok, _, _ in RECORDED)
    timed = [ms for _, ms, _ in RECORDED if ms is not None]
    assert int(tile(page, "attempts")) == len(RECORDED) and int(tile(page, "deaths")) == 2
    assert len(timed) % 2  # an odd count: one median, whichever way it is ranked
    assert float(tile(page, "success-rate")) == pytest.approx(successes / len(RECORDED), abs=1e-4)
    assert tile(page, "breaker") == "open" and 'data-window="1h"' in page
    for name, true_value in (("p50", statistics.median(timed)), ("p95", sorted(timed)[-1])):
        low, high = bucket_bounds(true_value)  # an estimate inside the true value's bucket
        assert low <= float(tile(page, name)) <= high, (name, true_value)
    quiet = client.get("/endpoint", params={"tenant": "acme", "origin": ENDPOINTS[0][1], "window": "15m"}).text
    assert tile(quiet, "attempts") == "0" and tile(quiet, "success-rate") == "" and 'data-window="15m"' in quiet
    bad = client.get("/endpoint", params={"tenant": tenant, "origin": origin, "window": "7d"})
    assert bad.status_code == 400 and "The health window must be one of: 15m, 1h, 24h." in bad.text
    overview = client.get("/").text

    def listed(origin: str) -> str | None:  # the success rate an overview row carries
        match = re.search(r'<td class="num" data-value="([\d.]*)">',
                          overview.split(f">{origin}</a>")[1].split("</tr>")[0])
        return match.group(1) if match else None

    assert listed(origin) == f"{successes / len(RECORDED):.4f}" and listed(ENDPOINTS[1][1]) == "1.0000"
    assert listed(ENDPOINTS[0][1]) == ""  # no attempt in the hour: no rate


def dead_matching(engine, tenant: str, since: float) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(messages).where(
            messages.c.state == "dead", messages.c.tenant_id == tenant, messages.c.finished_at >= since)).scalar_one()


def job_state(engine) -> list[tuple[str, int]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(jobs.c.state, jobs.c.total).order_by(jobs.c.id))]


def test_a_recovery_job_is_counted_started_paused_resumed_and_cancelled(engine, console):
    client, csrf, history = console
    form = {"csrf": csrf, "tenant": "globex", "since": "3d", "rate": "5"}
    dry = client.post("/jobs/start", data=form)
    matched = dead_matching(engine, "globex", history.now - 3 * 86400 - 60)
    count = re.search(r'id="job-dry-run-count"><strong>([\d,]+)</strong>', dry.text)
    assert dry.status_code == 200 and int(count.group(1)) == matched > 0 and job_state(engine) == []
    confirm = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', dry.text.split("confirm-job")[1]))
    started = client.post("/jobs/start", data=confirm, follow_redirects=False)
    assert started.status_code == 303 and started.headers["location"] == "/jobs/1?notice=job-started"
    again = client.post("/jobs/start", data=confirm, follow_redirects=False)  # a double click: the same job
    assert again.headers["location"] == started.headers["location"]
    assert job_state(engine) == [("running", matched)]
    page = client.get(started.headers["location"]).text
    assert "Recovery job started" in page and f'data-done="0" data-total="{matched}"' in page
    assert 'id="job-state" data-value="running"' in page and 'id="job-rate" data-value="5"' in page

    def act(action: str, **extra: str) -> str:
        answer = client.post(f"/jobs/1/{action}", data={"csrf": csrf, **extra}, follow_redirects=False)
        return client.get(answer.headers["location"]).text if answer.status_code == 303 else answer.text

    assert "Job paused" in act("pause") and job_state(engine) == [("paused", matched)]
    assert "Job resumed" in act("resume") and job_state(engine) == [("running", matched)]
    asked = act("cancel")
    assert 'id="confirm-cancel-button"' in asked and job_state(engine) == [
        ("running", matched)]  # asking changes nothing
    assert "Job cancelled" in act("cancel", confirm="yes") and job_state(engine) == [("cancelled", matched)]
    assert "Nothing changed: the job had already moved" in act("resume")
    listed = client.get("/jobs").text
    assert 'id="job-1"' in listed and 'class="badge cancelled"' in listed


def pending_matching(engine, tenant: str) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(messages).where(
            messages.c.state.in_(("pending", "in_flight")), messages.c.tenant_id == tenant)).scalar_one()


def test_a_cancel_pending_job_is_counted_then_started_from_its_own_form(engine, console):
    client, csrf, _ = console
    tenant = next(t for t in ("acme", "globex", "initech") if pending_matching(engine, t))
    listed = client.get("/jobs").text
    assert 'id="start-cancel-job"' in listed and 'name="kind" value="cancel"' in listed
    # A fraction, as `outboxd recover start --rate 2.5` takes it.
    dry = client.post("/jobs/start", data={"csrf": csrf, "kind": "cancel", "tenant": tenant, "rate": "2.5"})
    count = re.search(r'id="job-dry-run-count"><strong>([\d,]+)</strong>', dry.text)
    matched = pending_matching(engine, tenant)
    assert dry.status_code == 200 and int(count.group(1).replace(",", "")) == matched and job_state(engine) == []
    assert "pending or in-flight message(s) match now" in dry.text and "ended dead since" not in dry.text
    assert "at most 2.5 a second" in dry.text
    confirm = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', dry.text.split("confirm-job")[1]))
    assert confirm["kind"] == "cancel" and confirm["until"] == ""
    started = client.post("/jobs/start", data=confirm, follow_redirects=False)
    assert started.status_code == 303 and job_state(engine) == [("running", matched)]
    with engine.connect() as conn:
        row = conn.execute(select(jobs.c.kind, jobs.c.tenant_id, jobs.c.rate, jobs.c.reason)).one()
    assert tuple(row) == ("cancel", tenant, 2.5, None)
    page = client.get(started.headers["location"]).text
    assert "cancel pending" in page and "Enqueued" in page and "Dead reason" not in page
    assert 'class="badge cancelled"' not in client.get("/jobs").text and "cancel pending" in client.get("/jobs").text


def test_a_job_since_a_duration_ago_counts_back_from_the_databases_clock(engine, console, monkeypatch):
    """A console whose host clock is two hours ahead: "since 52w" is 52 weeks of the database's
    clock, and the confirmation carries that time (it carried the host's, and the started job
    selected a window two hours off: nothing, with the host ahead)."""
    import time

    from supervisor.cli import common

    client, csrf, _ = console
    tenant = next(t for t in ("acme", "globex", "initech") if pending_matching(engine, t))
    real = time.time
    monkeypatch.setattr(common.time, "time", lambda: real() + 7200)
    dry = client.post("/jobs/start", data={"csrf": csrf, "kind": "cancel", "tenant": tenant, "since": "52w"})
    confirm = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', dry.text.split("confirm-job")[1]))
    monkeypatch.setattr(common.time, "time", real)
    from datetime import datetime

    since = datetime.fromisoformat(confirm["since"].replace("Z", "+00:00")).timestamp()
    assert abs(since - (real() - 52 * 604800)) < 60, confirm["since"]
    started = client.post("/jobs/start", data=confirm, follow_redirects=False)
    assert started.status_code == 303 and job_state(engine) == [("running", pending_matching(engine, tenant))]


@pytest.mark.parametrize("engine", ["sqlite"], indirect=True)
def test_job_actions_refuse_forgery_and_answer_mistakes_with_a_sentence(engine, console):
    client, csrf, _ = console
    start = {"tenant": "globex", "since": "3d", "confirm": "yes"}
    assert client.post("/jobs/start", data=start).status_code == 403  # no CSRF token
    assert client.post("/jobs/start", data={**start, "csrf": "forged"}).status_code == 403
    assert client.post("/jobs/1/pause", data={"csrf": "forged"}).status_code == 403
    assert job_state(engine) == []
    for fields, words in (({"tenant": ""}, "needs a tenant and a time"), ({"since": "soonish"}, "Since: write a time"),
                          ({"rate": "fast"}, "“messages a second” 'fast' is not a number."),
                          ({"rate": "0"}, "“messages a second” must be above 0 and at most 100,000 messages a second."),
                          ({"reason": "exploded"}, "Reason must be one of:"),
                          ({"kind": "purge"}, "either replays dead messages or cancels pending ones"),
                          ({"kind": "cancel", "tenant": ""}, "Cancelling pending messages needs a tenant."),
                          ({"kind": "cancel", "since": "1h", "until": "2h"}, "“Enqueued until” is before"),
                          ({"kind": "cancel", "until": "later"}, "Enqueued until: write a time")):
        answer = client.post("/jobs/start", data={**start, "csrf": csrf, **fields})
        assert answer.status_code == 400 and words in unescape(answer.text) and "Traceback" not in answer.text
    assert job_state(engine) == []
    assert client.post("/jobs/1/explode", data={"csrf": csrf}).status_code == 404
    for ref in ("¹", "9" * 25, "7", "0"):
        assert client.get(f"/jobs/{ref}").status_code == 404
    assert client.get("/jobs/not-a-job").status_code == 404


def test_a_typed_origin_is_any_url_of_the_endpoint():
    for kind in ("replay", "cancel"):
        typed = {"tenant": "acme", "since": "2h", "kind": kind}
        assert job_selection({**typed, "origin": "HTTPS://Buyer.example:443/hook/"}).origin == "https://buyer.example"
        assert job_selection({**typed, "origin": ""}).origin is None
        with pytest.raises(BadInput, match="Origin"):
            job_selection({**typed, "origin": "buyer.example"})


@given(st.dictionaries(st.sampled_from(["tenant", "since", "until", "origin", "reason", "rate", "kind"]),
                      st.one_of(st.sampled_from(["cancel", "replay", "2h", "1h"]), st.text(max_size=30))))
@example({"tenant": "0"})
@example({"tenant": "000"})
@example({"tenant": "\r", "since": "2h"})
def test_any_typed_job_is_a_selection_or_a_sentence(fields):
    try:
        selection = job_selection(fields)
        assert selection.tenant_id and selection.tenant_id == fields["tenant"]  # a tenant id is taken exactly
        assert selection.kind in ("replay", "cancel")
        assert selection.until is None or selection.until >= selection.since
    except BadInput as exc:
        assert "Traceback" not in str(exc) and "invalid literal" not in str(exc)
    try:
        assert 0 < job_rate(fields.get("rate")) <= JOB_RATE_MAX
    except BadInput as exc:
        assert "not a number" in str(exc) or "above 0" in str(exc)
    number = row_id(fields.get("tenant", ""))
    assert number is None or 0 < number < 2**63
