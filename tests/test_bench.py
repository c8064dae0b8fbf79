"""``outboxd bench`` end to end, with tiny parameters: every figure is measured and reported.

No timing threshold is asserted (this box is shared and small); the point is that each phase
runs real processes against real PostgreSQL, stops by itself, and reports a number.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from outbox.config import load_settings
from outbox.db import libpq_url, make_engine
from outbox.migrate import upgrade
from outboxd_bench import run_bench
from outboxd_bench.procs import BenchUsageError
from outboxd_bench.report import meter_readings
from outboxd_bench.run import Terminated, signals_deferred, sigterm_unwinds
from supervisor.cli import main
from tests.procs import outboxd, wait_until


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
    values = {"messages": 120, "rate": 50.0, "duration": 1.5, "bare_concurrency": "1,8", "shared_tenants": 20,
              "origins": 3, "scale_rows": 5_000, "endpoints": 200, "recovery_messages": 200, "json": True}
    values.update(overrides)
    return argparse.Namespace(**values)


def test_bench_reports_every_figure(bench_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    settings = load_settings(env={"OUTBOX_DATABASE_URL": bench_url})
    assert run_bench(settings, _args()) == 0
    report = json.loads(capsys.readouterr().out)

    assert report["errors"] == {}
    cases = ("one_origin", "shared_origin", "many_origins", "two_daemons")
    expected = {f"{case}_{figure}" for case in cases for figure in (
        "deliveries_per_s", "cpu_ms_per_delivery", "postgres_cpu_ms_per_delivery", "ratio_to_bare", "tail_ratio")}
    expected |= {"bare_best_requests_per_s", "bare_best_cpu_ms_per_request", "ratio_two_daemons_to_one",
                 "latency_p50_ms", "latency_p95_ms", "latency_p99_ms", "isolation_healthy_p99_ms",
                 "isolation_p99_ratio", "claim_ms_empty", "claim_ms_scaled", "claim_time_ratio", "rss_mb_10k_due",
                 "claim_buffers_10_endpoints", "claim_buffers_200_endpoints", "endpoints_claim_buffers_ratio",
                 "endpoints_few_deliveries_per_s", "endpoints_many_deliveries_per_s", "endpoints_rate_ratio",
                 "enqueue_task_webhook_added_p50_ms", "enqueue_delivery_report_added_p50_ms",
                 "enqueue_event_added_p50_ms", "one_origin_total_cpu_ratio_to_bare",
                 "recovery_p99_ms_without_job", "recovery_p99_ms_with_job", "recovery_p99_ratio"}
    figures = report["figures"]
    assert expected <= figures.keys()
    for name in expected:
        assert isinstance(figures[name], (int, float)) and math.isfinite(figures[name]), name
        # What an enqueue adds is a difference of two medians: in a short run on a busy box it
        # may come out a hair below zero; every other figure is a positive measurement.
        assert figures[name] > (-0.5 if name.endswith("_added_p50_ms") else 0), (name, figures[name])
    assert figures["bare_best_concurrency"] in (1, 8)
    phases = report["phases"]
    assert {"bare_c1", "bare_c8", "bare_c1_again", "bare_c8_again"} <= phases.keys()
    for case in cases:
        assert phases[f"throughput_{case}"]["delivered"] == 120, case
        assert figures[f"{case}_duplicates"] == 0, case
    assert len(phases["throughput_two_daemons"]["cpu_s_per_daemon"]) == 2
    # every timed run a target judges carries its meter's reading, for the noise warning
    metered = {"latency_recovery.without_job", "latency_recovery.with_job", "endpoints.drain_few",
               "endpoints.drain_many", "enqueue", "latency_healthy", "throughput_one_origin"}
    assert metered <= meter_readings(phases).keys()
    assert report["options"]["tls"] is True  # HTTPS by default, trusted through OUTBOX_TLS_CA_FILE
    assert phases["latency_isolation"]["hanging_tenant_requests"] > 0  # reached /hang, never answered
    assert phases["scale"]["scaled"]["history_rows"] == 5_000
    assert list(phases["endpoints"]["claims"]) == ["10", "20", "200"]
    wrk = phases["wrk"]  # the C-client baseline, or why it did not run
    assert (wrk["requests_per_s"] > 0 and wrk["non_2xx"] == 0) if wrk["available"] else "not installed" in wrk["reason"]
    judged = {t["target"] for t in report["targets"]}
    assert any("daemon + PostgreSQL CPU" in t for t in judged)
    assert any("x wrk" in t for t in judged) == wrk["available"]
    assert phases["endpoints"]["drain_many"]["endpoints_delivered_to"] > 10  # the backlog really spans them
    assert isinstance(phases["scale"]["empty"]["uses_due_idx"], bool)
    assert report["receiver"]["verifies_signatures"] is False
    assert report["checkpoints_between_phases"] is True  # each phase began on a settled server
    assert {t["target"] for t in report["targets"]} and all(isinstance(t["pass"], bool) for t in report["targets"])
    # The bench leaves the outbox empty behind it.
    with psycopg.connect(libpq_url(bench_url)) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_messages").fetchone() == (0,)


def test_bench_refuses_sqlite(tmp_path: object) -> None:
    settings = load_settings(env={"OUTBOX_DATABASE_URL": "sqlite:///bench.db"})
    with pytest.raises(BenchUsageError, match="PostgreSQL"):
        run_bench(settings, _args())


def test_bench_refuses_a_non_empty_outbox(bench_url: str, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    with psycopg.connect(libpq_url(bench_url)) as conn:
        conn.execute("INSERT INTO outbox_sequences (stream_key, last_value) VALUES ('someone', 1)")
    monkeypatch.setenv("OUTBOX_DATABASE_URL", bench_url)
    assert main(["bench", "--messages", "10"]) == 1
    err = capsys.readouterr().err
    assert "not empty" in err and len(err.strip().splitlines()) == 1


def test_bench_only_runs_the_named_phases(bench_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    settings = load_settings(env={"OUTBOX_DATABASE_URL": bench_url})
    assert run_bench(settings, _args(only="bare_c1", bare_concurrency="1")) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["phases"]) == ["bare_c1"] and report["phases"]["bare_c1"]["requests_per_s"] > 0
    assert "figures" not in report  # ratios need the phases they compare
    with pytest.raises(BenchUsageError, match="no phase named nosuch"):
        run_bench(settings, _args(only="bare_c1,nosuch"))


def test_the_recovery_phase_reports_live_p99_without_and_with_a_replay_job(bench_url: str,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    settings = load_settings(env={"OUTBOX_DATABASE_URL": bench_url})
    assert run_bench(settings, _args(only="latency_recovery", duration=3.0, recovery_messages=400)) == 0
    report = json.loads(capsys.readouterr().out)
    phase = report["phases"]["latency_recovery"]
    assert report["errors"] == {} and report["options"]["recovery_messages"] == 400
    for run in ("without_job", "with_job"):  # both measured, side by side (the ratio is not judged here)
        assert phase[run]["arrived"] > 0 and phase[run]["p99_ms"] > 0, run
        assert "other_share" in phase[run]["cpu"], run  # what the noise warning judges
    assert phase["p99_ratio"] == round(phase["with_job"]["p99_ms"] / phase["without_job"]["p99_ms"], 3)
    assert phase["job"]["messages"] == 400 and phase["job"]["rate_per_s"] == 50  # the default rate
    assert 0 < phase["job"]["replayed_during_run"] <= 400


def test_a_role_that_may_not_checkpoint_still_benches_and_is_told_why(
        pg_server_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Phases begin with a CHECKPOINT (the previous phase's writes flushed before this one is
    timed); a role that may not run one gets its figures and one warning, not a failure."""
    name = f"outboxd_bench_nocp_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_server_url, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{name}" LOGIN')
        conn.execute(f'CREATE DATABASE "{name}" OWNER "{name}"')
    url = make_url(pg_server_url).set(database=name, username=name).render_as_string(hide_password=False)
    try:
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        settings = load_settings(env={"OUTBOX_DATABASE_URL": url})
        assert run_bench(settings, _args(only="latency_healthy", json=False)) == 0
        captured = capsys.readouterr()
        assert "all healthy" in captured.out
        assert "WARNING: the server refused CHECKPOINT" in captured.out
        assert captured.err.count("CHECKPOINT refused") == 1
    finally:
        with psycopg.connect(pg_server_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'DROP ROLE IF EXISTS "{name}"')


def test_bench_peer_adcp_without_the_sdk_stops_before_any_phase(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Without the SDK, ``--peer adcp`` says so in one line and runs nothing: failing in the
    peer's phase left a run with an error and no TARGETS section."""
    monkeypatch.setitem(sys.modules, "adcp", None)  # `import adcp` raises ImportError
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://postgres@127.0.0.1:1/unreachable")
    assert main(["bench", "--peer", "adcp", "--messages", "10"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "adcp" in err and "[test]" in err and "[1/" not in err


def _descendants(root: int) -> set[int]:
    """The live processes below ``root``, from each process's parent in ``/proc``."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError):
            continue  # gone meanwhile
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie: a child orphaned to a PID 1 that does not reap stays a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_cleans_up_as_sigint_does(bench_url: str, tmp_path: Path) -> None:
    """SIGTERM (a service manager, a CI job's timeout) mid-phase: every child stopped, the outbox
    emptied and the scratch directory with its keys removed, exit 143; so the next run starts."""
    env = {**os.environ, "OUTBOX_DATABASE_URL": bench_url, "TMPDIR": str(tmp_path)}
    bench = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "bench", "--only", "latency_healthy",
                              "--rate", "50", "--duration", "60"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    children: set[int] = set()

    def mid_phase() -> bool:  # the daemon started and messages committed
        children.update(_descendants(bench.pid))
        with psycopg.connect(libpq_url(bench_url)) as conn:
            return conn.execute("SELECT count(*) FROM outbox_messages").fetchone()[0] > 0

    try:
        assert wait_until(mid_phase, 90), "the phase never committed a message"
        assert len(children) >= 4  # three receivers and a daemon
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 143
    finally:
        if bench.poll() is None:
            bench.kill()
        left = [pid for pid in children if _running(pid)]
        for pid in left:  # so that a failure here leaves nothing running either
            os.kill(pid, signal.SIGKILL)
    assert left == []
    assert list(tmp_path.iterdir()) == []
    with psycopg.connect(libpq_url(bench_url)) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_messages").fetchone() == (0,)
    outboxd(env, "bench", "--only", "bare_c1", "--bare-concurrency", "1", "--messages", "20", exit_code=0)


def test_a_stop_during_the_teardown_waits_for_it() -> None:
    """A SIGTERM that lands while the bench tears down is acted on once the teardown is done,
    with another thread running too (a CPU meter's sampler, left by a stopped phase)."""
    finished, release = [], threading.Event()
    threading.Thread(target=release.wait, daemon=True).start()
    try:
        with pytest.raises(Terminated):
            with sigterm_unwinds(), signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)  # a handler that raised would have done so by now
                finished.append(True)
    finally:
        release.set()
    assert finished == [True]
