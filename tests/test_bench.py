"""``outboxd bench`` end to end, with tiny parameters: every figure is measured and reported.

No timing threshold is asserted (this box is shared and small); the point is that each phase
runs real processes against real PostgreSQL, stops by itself, and reports a number.
"""

from __future__ import annotations

import argparse
import json
import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy.engine import make_url

from outbox.config import load_settings
from outbox.db import make_engine
from outbox.migrate import upgrade
from supervisor.bench import run_bench
from supervisor.cli import UserError, main


@pytest.fixture
def bench_url(pg_server_url: str) -> Iterator[str]:
    name = f"outboxd_bench_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_url(pg_server_url).set(database=name).render_as_string(hide_password=False)
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    yield url
    with psycopg.connect(pg_server_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _args(**overrides: object) -> argparse.Namespace:
    values = {"messages": 200, "rate": 50.0, "duration": 2.0, "concurrency": 16, "scale_rows": 20_000, "json": True}
    values.update(overrides)
    return argparse.Namespace(**values)


def test_bench_reports_every_figure(bench_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    settings = load_settings(env={"OUTBOX_DATABASE_URL": bench_url})
    assert run_bench(settings, _args()) == 0
    report = json.loads(capsys.readouterr().out)

    assert report["errors"] == {}
    expected = {
        "one_daemon_deliveries_per_s", "one_daemon_cpu_s_per_1000", "one_daemon_peak_rss_mb",
        "two_daemons_deliveries_per_s", "two_daemons_cpu_s_per_1000", "two_daemons_peak_rss_mb",
        "bare_httpx_requests_per_s", "bare_httpx_cpu_s_per_1000", "ratio_one_daemon_to_bare",
        "ratio_two_daemons_to_one", "latency_p50_ms", "latency_p95_ms", "latency_p99_ms",
        "isolation_healthy_p50_ms", "isolation_healthy_p95_ms", "isolation_healthy_p99_ms", "isolation_p99_ratio",
        "claim_ms_empty", "claim_ms_scaled", "claim_time_ratio", "rss_mb_10k_due",
    }
    figures = report["figures"]
    assert expected <= figures.keys()
    for name in expected:
        assert isinstance(figures[name], (int, float)) and figures[name] > 0, name
    phases = report["phases"]
    assert phases["throughput_one_daemon"]["delivered"] == 200
    assert phases["throughput_two_daemons"]["delivered"] == 200
    assert len(phases["throughput_two_daemons"]["cpu_s_per_daemon"]) == 2
    assert phases["latency_isolation"]["hanging_tenant_requests"] > 0  # reached /hang, never answered
    assert phases["scale"]["scaled"]["history_rows"] == 20_000
    assert isinstance(phases["scale"]["empty"]["uses_due_idx"], bool)
    assert report["receiver"]["verifies_signatures"] is False
    assert {t["target"] for t in report["targets"]} and all(isinstance(t["pass"], bool) for t in report["targets"])
    # The bench leaves the outbox empty behind it.
    with psycopg.connect(make_url(bench_url).set(drivername="postgresql").render_as_string(False)) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_messages").fetchone() == (0,)


def test_bench_refuses_sqlite(tmp_path: object) -> None:
    settings = load_settings(env={"OUTBOX_DATABASE_URL": "sqlite:///bench.db"})
    with pytest.raises(UserError, match="PostgreSQL"):
        run_bench(settings, _args())


def test_bench_refuses_a_non_empty_outbox(bench_url: str, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    with psycopg.connect(make_url(bench_url).set(drivername="postgresql").render_as_string(False)) as conn:
        conn.execute("INSERT INTO outbox_sequences (stream_key, last_value) VALUES ('someone', 1)")
    monkeypatch.setenv("OUTBOX_DATABASE_URL", bench_url)
    assert main(["bench", "--messages", "10"]) == 1
    err = capsys.readouterr().err
    assert "not empty" in err and len(err.strip().splitlines()) == 1
