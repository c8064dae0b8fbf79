"""The console's charts and health strip show what the attempt rows hold, on both databases,
read from the endpoint-health rollup (never the attempt history)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sqlalchemy import func, select

from outbox.db import make_async_engine
from outbox.schema import messages
from supervisor.ui import queries
from supervisor.ui.forms import REPLAY_LIMIT_MAX, BadInput, filters_from, page_start, replay_limit
from supervisor.ui.present import duration, label, when
from supervisor.ui.timeseries import DAY, HOUR, Scope, bounds, series, series_query
from tests.console_history import DUE_AGO, ENDPOINTS, OPEN_ENDPOINT, QUIET_TO, attempt_rows, seed, tally


@pytest.fixture
async def seeded(engine, tmp_path):
    history = seed(engine, tmp_path)
    aengine = make_async_engine(engine.url.render_as_string(hide_password=False))
    yield engine, aengine, history
    await aengine.dispose()


@pytest.mark.parametrize("scope", [Scope(), Scope(tenant="acme"), Scope(*OPEN_ENDPOINT), Scope(*ENDPOINTS[0])],
                         ids=["everyone", "tenant", "open-endpoint", "endpoint"])
async def test_every_bucket_counts_what_the_rows_hold(seeded, scope):
    engine, aengine, history = seeded
    rows = attempt_rows(engine)
    for window in (HOUR, DAY):
        async with aengine.connect() as conn:
            drawn = await series(conn, window, scope, history.now)
        assert len(drawn.buckets) == window.buckets
        assert drawn.buckets[0].start == bounds(window, history.now)[0]
        assert drawn.buckets[-1].start <= history.now < drawn.buckets[-1].start + window.bucket
        for bucket in drawn.buckets:
            expected = tally(rows, bucket.start, bucket.start + window.bucket, scope.tenant, scope.origin)
            assert (bucket.delivered, bucket.failed) == (expected.delivered, expected.failed), bucket
            assert bucket.latency_avg_ms == pytest.approx(expected.latency_avg_ms)
            assert bucket.latency_max_ms == expected.latency_max_ms
        assert drawn.delivered + drawn.failed > 0  # the history reaches every window and scope


async def test_health_strip_numbers(seeded):
    engine, aengine, history = seeded
    rows = attempt_rows(engine)
    async with aengine.connect() as conn:
        health = await queries.health(conn, Scope())
        endpoint = await queries.health(conn, Scope(*OPEN_ENDPOINT))
    recent = tally(rows, history.now - QUIET_TO, history.now + 60)
    assert health.backlog == history.pending
    assert health.daemons == recent.daemons > 0
    # The five whole minutes before the current one and the current one so far.
    span = queries.RATE_SECONDS + health.now % 60
    assert health.delivered_per_minute == pytest.approx(recent.delivered * 60 / span)
    assert health.failure_ratio == pytest.approx(recent.failed / (recent.delivered + recent.failed))
    assert health.oldest_due_seconds >= DUE_AGO
    assert (health.open_breakers, endpoint.open_breakers) == (1, 1)
    assert health.keys == {"active": 1, "next": 1} and health.keyless_scopes == []
    assert endpoint.backlog < health.backlog


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
async def test_the_day_chart_reads_a_range_of_the_rollup_only(seeded):
    """EXPLAIN of a tenant's day query: the rollup's index by endpoint and minute, no attempt table."""
    engine, _, history = seeded
    compiled = series_query(DAY, Scope(tenant="acme"), history.now).compile(
        dialect=engine.dialect, compile_kwargs={"render_postcompile": True})
    with engine.connect() as conn:
        conn.exec_driver_sql("SET enable_seqscan = off")  # a few rows: the planner would scan them all
        plan = "\n".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN {compiled}", compiled.params))
    assert "outbox_endpoint_stats_endpoint_idx" in plan and "outbox_attempts" not in plan, plan


@given(st.text(max_size=30))
def test_any_typed_limit_is_a_number_in_range_or_a_sentence(text):
    try:
        assert 1 <= replay_limit(text) <= REPLAY_LIMIT_MAX
    except BadInput as exc:
        assert "whole number" in str(exc)
    try:
        assert page_start(text) is None or page_start(text) >= 1
    except BadInput as exc:
        assert "whole number" in str(exc)


@given(st.dictionaries(st.sampled_from(["tenant", "state", "reason", "since", "until"]), st.text(max_size=30)))
def test_any_search_is_a_filter_or_a_sentence(fields):
    try:
        filters_from(fields)
    except BadInput as exc:
        assert "Traceback" not in str(exc) and "invalid literal" not in str(exc)


def test_words_and_times():
    assert [label(w) for w in ("in_flight", "signature_rejected", "tenant_id", "connection_error")] == \
        ["In flight", "Signature rejected", "Tenant", "Connection error"]
    assert [duration(s) for s in (0.2, 59, 61, 3600, 3725, 90000)] == \
        ["under 1 s", "59 s", "1 min 1 s", "1 h", "1 h 2 min", "1 d 1 h"]
    assert str(when(1000.0, 1125.0)) == \
        '<time datetime="1970-01-01T00:16:40.000Z" title="1970-01-01T00:16:40.000Z">2 min 5 s ago</time>'
    assert "in 1 h" in str(when("1970-01-01T01:00:00.000Z", 0.0)) and str(when(None, 0.0)) == "–"


async def test_endpoints_put_open_breakers_first_and_count_the_rest(seeded):
    engine, aengine, _ = seeded
    with engine.connect() as conn:
        waiting = {(t, o): n for t, o, n in conn.execute(
            select(messages.c.tenant_id, messages.c.origin, func.count())
            .where(messages.c.state.in_(("pending", "in_flight"))).group_by(messages.c.tenant_id, messages.c.origin))}
    async with aengine.connect() as conn:
        shown, more = await queries.endpoints(conn, Scope(), limit=2)
        everyone, none_more = await queries.endpoints(conn, Scope(), limit=10)
        acme, _ = await queries.endpoints(conn, Scope(tenant="acme"), limit=10)
    assert (shown[0]["tenant_id"], shown[0]["origin"], shown[0]["breaker"]["state"]) == (*OPEN_ENDPOINT, "open")
    assert more == 1 and none_more == 0 and len(everyone) == 3
    assert {(e["tenant_id"], e["origin"]): e["backlog"] for e in everyone} == waiting
    assert {e["origin"] for e in acme} == {o for t, o in ENDPOINTS if t == "acme"}


async def test_every_page_renders_on_sqlite(sqlite_engine, sqlite_url, tmp_path):
    """The console in process on SQLite: the same pages, the same numbers as PostgreSQL's."""
    from starlette.testclient import TestClient

    from outbox.config import load_settings
    from supervisor.ui.app import make_app

    history = seed(sqlite_engine, tmp_path, per_endpoint=10)
    settings = load_settings(env={"OUTBOX_DATABASE_URL": sqlite_url})
    with TestClient(make_app(settings, "t" * 32)) as client:
        assert client.post("/login", data={"token": "t" * 32}, follow_redirects=False).status_code == 303
        overview = client.get("/").text
        assert f'id="health-backlog"><div class="k">Backlog</div><div class="v" data-value="{history.pending}"' \
            in overview
        endpoint = client.get("/endpoint", params=dict(zip(("tenant", "origin"), OPEN_ENDPOINT)))
        assert endpoint.status_code == 200 and 'class="badge open"' in endpoint.text
        assert client.get("/messages", params={"state": "dead"}).status_code == 200
        assert "Failed" in client.get(f"/messages/{history.featured}").text


async def test_signing_keys_name_the_scopes_that_cannot_sign(engine, tmp_path):
    from supervisor.keys import keyring
    from supervisor.wire.signing import generate_signing_key_pem, load_signing_key

    seed(engine, tmp_path, per_endpoint=1)  # the default scope: one active key, one staged
    with engine.begin() as conn:
        path = tmp_path / "acme-next.pem"
        path.write_bytes(generate_signing_key_pem("ed25519"))
        keyring.stage(conn, scope="acme", key=load_signing_key(path, "acme-next"), key_file=str(path))
    aengine = make_async_engine(engine.url.render_as_string(hide_password=False))
    try:
        async with aengine.connect() as conn:
            staged_only = await queries.health(conn, Scope())
        with engine.begin() as conn:
            keyring.revoke(conn, "console-active")
        async with aengine.connect() as conn:
            revoked = await queries.health(conn, Scope())
    finally:
        await aengine.dispose()
    assert staged_only.keyless_scopes == []  # acme signs with the default scope's key until its own is active
    assert staged_only.keys == {"active": 1, "next": 2}
    assert revoked.keyless_scopes == [keyring.scope_label(keyring.DEFAULT_SCOPE)] and revoked.keys["revoked"] == 1
