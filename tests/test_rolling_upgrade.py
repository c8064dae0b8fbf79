"""Rolling upgrades: mixed-version fleets keep delivering.

The rule (docs/architecture.md, "Rolling upgrades"): migrations are additive and each
records the oldest code revision that can still run on it. Release N's code is simulated
honestly: this very tree copied with the newest migration file removed, so its head is the
previous revision, run as a real daemon process against a database migrated by release N+1.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from outbox.db import make_engine
from outbox.migrate import head_revision, upgrade
from tests import procs
from tests.ledger import enqueue_many, finished
from tests.procs import free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent
VERSIONS = Path("outbox/migrations/versions")


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory) -> tuple[Path, str]:
    """This tree without its newest migration: (its root, its head revision)."""
    root = tmp_path_factory.mktemp("previous-release")
    for package in ("outbox", "supervisor", "sinks"):
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root)
    [newest] = [p for p in (root / VERSIONS).glob("*.py") if f'revision = "{head_revision()}"' in p.read_text()]
    previous = next(line.split('"')[1] for line in newest.read_text().splitlines()
                    if line.startswith("down_revision = "))
    newest.unlink()
    return root, previous


def start(code_root: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    env = {**env, "PYTHONPATH": str(code_root)}
    return subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run"], env=env, cwd=code_root,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def test_a_daemon_one_revision_behind_keeps_delivering(previous_release, pg_engine, pg_url, tmp_path):
    old_root, old_head = previous_release
    assert old_head != head_revision()
    key, jwks = procs.make_key(tmp_path)
    port = free_port()
    with procs.receiver(tmp_path, jwks, verifier="library") as (receiver_port, log):
        enqueue_many(pg_engine, f"http://127.0.0.1:{receiver_port}", ["/ok"] * 5)
        daemon = start(old_root, procs.daemon_env(pg_url, key, metrics_addr=f"127.0.0.1:{port}"),
                       tmp_path / "old.log")
        try:
            assert procs.wait_until(lambda: finished(pg_engine, 5), 40), (tmp_path / "old.log").read_text()[-800:]
            assert procs.readyz(port) == (200, "ready\n")
        finally:
            assert procs.stop(daemon) == 0
    assert len(procs.arrivals(log)) == 5


def test_a_database_too_new_for_the_daemon_is_refused_in_one_line(previous_release, sqlite_url, tmp_path):
    old_root, old_head = previous_release
    with make_engine(sqlite_url).begin() as conn:  # the newest migration now needs its own code
        conn.execute(text("UPDATE outbox_schema_compat SET min_reader_revision = :rev"), {"rev": head_revision()})
    key, _ = procs.make_key(tmp_path)
    run = subprocess.run([sys.executable, "-m", "supervisor.cli", "run"], capture_output=True, text=True,
                         timeout=60, cwd=old_root,
                         env={**procs.daemon_env(sqlite_url, key), "PYTHONPATH": str(old_root)})
    assert run.returncode == 1 and run.stderr.count("\n") == 1
    assert f"database schema is at {head_revision()}, newer than this outboxd ({old_head})" in run.stderr


def test_a_running_daemon_stops_in_one_line_once_the_database_is_too_new_for_it(previous_release, pg_engine,
                                                                                pg_url, tmp_path):
    """A migration that breaks older readers may run while an old daemon delivers (migrate
    first is the documented order): that daemon stops claiming and exits 1 with the line it
    would refuse to start with, rather than write to a schema it cannot read."""
    old_root, old_head = previous_release
    key, jwks = procs.make_key(tmp_path)
    with procs.receiver(tmp_path, jwks, verifier="library") as (receiver_port, log):
        enqueue_many(pg_engine, f"http://127.0.0.1:{receiver_port}", ["/ok"])
        daemon = start(old_root, procs.daemon_env(pg_url, key), tmp_path / "old.log")
        with pg_engine.connect() as conn:  # kept between tests (tests/tables.py): put back after
            recorded = conn.execute(text("SELECT revision, min_reader_revision FROM outbox_schema_compat")).all()
        try:
            assert procs.wait_until(lambda: finished(pg_engine, 1), 40), (tmp_path / "old.log").read_text()[-800:]
            with pg_engine.begin() as conn:
                conn.execute(text("UPDATE outbox_schema_compat SET min_reader_revision = :rev"),
                             {"rev": head_revision()})
            assert daemon.wait(30) == 1
        finally:
            procs.stop(daemon)
            with pg_engine.begin() as conn:
                for revision, min_reader in recorded:
                    conn.execute(text("UPDATE outbox_schema_compat SET min_reader_revision = :m WHERE revision = :r"),
                                 {"m": min_reader, "r": revision})
    last = (tmp_path / "old.log").read_text().splitlines()[-1]
    assert last == (f"outboxd run: database schema is at {head_revision()}, newer than this outboxd ({old_head}) "
                    "can read: upgrade outboxd")


def test_a_daemon_waits_for_a_database_behind_it_then_runs(previous_release, tmp_path):
    _, old_head = previous_release
    url = f"sqlite:///{tmp_path / 'behind.db'}"
    upgrade(make_engine(url), old_head)
    key, jwks = procs.make_key(tmp_path)
    port = free_port()
    with procs.receiver(tmp_path, jwks, verifier="library") as (receiver_port, log):
        engine = make_engine(url)
        enqueue_many(engine, f"http://127.0.0.1:{receiver_port}", ["/ok"])
        daemon = start(ROOT, procs.daemon_env(url, key, metrics_addr=f"127.0.0.1:{port}"), tmp_path / "new.log")
        try:
            assert procs.wait_until(lambda: _listening(port) and procs.readyz(port)[0] == 503, 40)
            status, body = procs.readyz(port)
            assert f"at {old_head}, this outboxd needs {head_revision()}: waiting for `outboxd migrate`" in body
            assert daemon.poll() is None and not procs.arrivals(log)  # waiting, not exiting, not sending
            assert _ready_gauge(port) == 0  # what an alert sees of a daemon that waits (up is 1)
            upgrade(engine)
            assert procs.wait_until(lambda: finished(engine, 1), 40)
            assert procs.readyz(port) == (200, "ready\n")
            assert procs.wait_until(lambda: _ready_gauge(port) == 1, 10)
        finally:
            assert procs.stop(daemon) == 0
            engine.dispose()


def _ready_gauge(port: int) -> float | None:
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families
    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        families = text_string_to_metric_families(response.read().decode())
    return next((s.value for f in families if f.name == "outbox_ready" for s in f.samples), None)


def _listening(port: int) -> bool:
    try:
        procs.readyz(port)
        return True
    except OSError:
        return False
