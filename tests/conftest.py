"""Shared fixtures: a private PostgreSQL database per test run, fresh SQLite files, settings."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import closing
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest
from hypothesis import settings as hypothesis_settings
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url

from outbox.config import Settings
from outbox.db import make_engine
from outbox.migrate import upgrade
from tests import pgserver, procs, ts_sdk
from tests.ledger import THROWAWAY_KEY, loopback_producer
from tests.pgcluster import PgCluster
from tests.seller_transactions import enqueue_task
from tests.tables import EMPTIED_TABLES

# `pytest --hypothesis-profile=slow`: property tests that size themselves from the profile
# (tests/test_url_fidelity.py) run 5,000 examples instead of their default.
hypothesis_settings.register_profile("slow", max_examples=5_000, deadline=None)
# No per-example deadline by default: the suite runs on a busy 2-core box, where a 200 ms
# bound fails examples for the machine's load, not the code's speed.
hypothesis_settings.register_profile("outboxd", deadline=None)
if getattr(hypothesis_settings, "_current_profile", "default") == "default":
    hypothesis_settings.load_profile("outboxd")


@pytest.fixture(scope="session")
def pg_server_url() -> str:
    try:
        return pgserver.server_url()
    except RuntimeError as exc:
        pytest.exit(f"PostgreSQL unavailable: {exc}", returncode=2)


@pytest.fixture(scope="session")
def pg_url(pg_server_url: str) -> Iterator[str]:
    """A database created for this test run (so concurrent runs never collide), migrated."""
    name = f"outboxd_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_url(pg_server_url).set(database=name).render_as_string(hide_password=False)
    upgrade(make_engine(url))
    yield url
    with psycopg.connect(pg_server_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def fresh_db(pg_server_url: str) -> Iterator[str]:
    """A PostgreSQL database of its own, not migrated: for tests that change the schema or
    need it absent."""
    name = f"outboxd_fresh_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield make_url(pg_server_url).set(database=name).render_as_string(hide_password=False)
    with psycopg.connect(pg_server_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``session_end`` go last: what they wait for ran meanwhile."""
    items.sort(key=lambda item: item.get_closest_marker("session_end") is not None)  # stable


@pytest.fixture(autouse=True)
def _machine_share(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A test marked ``slow`` (the chaos run) has the machine to itself; others share it.

    Its bounds (how many leases SIGKILLed daemons leave behind) assume daemons that get the
    CPU they ask for; beside another pytest-xdist worker's test on a 2-core machine the
    completer lags and they do not. Every test takes a shared lock, a slow one an exclusive
    one, in a directory all workers of the run share; a turnstile taken around each request
    keeps the other worker's next test from slipping in ahead of a slow one that waits.
    In one process (``-n 0``) there is no other worker, and no lock.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    base = tmp_path_factory.getbasetemp().parent  # the run's directory, above each worker's
    alone = request.node.get_closest_marker("slow") is not None
    with open(base / "outboxd-machine.lock", "a") as lock, open(base / "outboxd-machine.turnstile", "a") as turnstile:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def ts_sdk_version() -> str:
    """The pinned TypeScript ``@adcp/sdk``, installed by ``npm ci`` if missing (tests/ts_sdk.py)."""
    return ts_sdk.install()


# Above this many rows deleted from a table, it is vacuumed as well, so that the next test
# does not read what this one left dead.
_VACUUM_AFTER_ROWS = 1_000


def _empty(engine: Engine) -> None:
    """Empty the run's PostgreSQL database for the next test, identities restarted at 1.

    Deletes rather than truncates: a ``TRUNCATE`` of these tables makes new files for each
    of them, their indexes and the attempt partitions, 0.3-0.5 s a test on a 2-core box,
    where deleting the few rows a test wrote takes milliseconds.
    """
    with engine.begin() as conn:
        deleted = {table: conn.exec_driver_sql(f"DELETE FROM {table}").rowcount for table in EMPTIED_TABLES}
        # What TRUNCATE ... RESTART IDENTITY restarts: the sequences these tables own.
        conn.exec_driver_sql(
            "SELECT setval(d.objid::regclass, 1, false) FROM pg_depend AS d "
            "JOIN pg_class AS s ON s.oid = d.objid AND s.relkind = 'S' "
            "WHERE d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_class'::regclass "
            "AND d.deptype IN ('a', 'i') AND d.refobjid = ANY(%(tables)s::regclass[])",
            {"tables": list(EMPTIED_TABLES)})
    large = [table for table, rows in deleted.items() if rows > _VACUUM_AFTER_ROWS]
    if large:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(f"VACUUM {', '.join(large)}")


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    engine = make_engine(pg_url)
    _empty(engine)
    yield engine
    engine.dispose()


def _public_objects(conn: psycopg.Connection) -> tuple[set[str], set[str]]:
    """The tables and the functions (with their argument types) in ``conn``'s schema."""
    tables = set(conn.execute("SELECT quote_ident(relname) FROM pg_class WHERE relkind IN ('r', 'p')"
                              " AND relnamespace = current_schema()::regnamespace").fetchall())
    functions = set(conn.execute("SELECT oid::regprocedure::text FROM pg_proc"
                                 " WHERE pronamespace = current_schema()::regnamespace").fetchall())
    return {t for (t,) in tables}, {f for (f,) in functions}


@pytest.fixture
def sdk_queues(pg_url: str) -> Iterator[str]:
    """The adcp SDK's PostgreSQL reporting queues (ledger and status) in the run's database,
    for one test: the tables and functions their schema adds are dropped after, so the
    run's later tests find outboxd's tables only. The database's URL."""
    from tests.reporting_world import create_sdk_queues

    with psycopg.connect(pg_url, autocommit=True) as conn:
        tables, functions = _public_objects(conn)
    create_sdk_queues(pg_url)
    yield pg_url
    with psycopg.connect(pg_url, autocommit=True) as conn:
        tables_now, functions_now = _public_objects(conn)
        if tables_now - tables:
            conn.execute(f"DROP TABLE IF EXISTS {', '.join(sorted(tables_now - tables))} CASCADE")
        for function in sorted(functions_now - functions):
            conn.execute(f"DROP FUNCTION IF EXISTS {function} CASCADE")


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One migrated SQLite database per run, which each test copies (migrating takes ~0.2 s)."""
    path = tmp_path_factory.mktemp("sqlite-template") / "outbox.db"
    engine = make_engine(f"sqlite:///{path}")
    upgrade(engine)
    engine.dispose()
    return path


@pytest.fixture
def sqlite_url(tmp_path: Path, sqlite_template: Path) -> str:
    """A migrated SQLite database of the test's own: a copy of the run's template."""
    target = tmp_path / "outbox.db"
    with closing(sqlite3.connect(sqlite_template)) as source, closing(sqlite3.connect(target)) as copy:
        source.backup(copy)
    return f"sqlite:///{target}"


@pytest.fixture
def sqlite_engine(sqlite_url: str) -> Iterator[Engine]:
    engine = make_engine(sqlite_url)
    yield engine
    engine.dispose()


@pytest.fixture
def keypair(tmp_path: Path) -> tuple[Path, Path]:
    """A signing key PEM and its public JWKS file, for a daemon and a verifying receiver."""
    return procs.make_key(tmp_path)


@pytest.fixture(scope="module")
def cluster() -> Iterator[PgCluster]:
    """A private PostgreSQL cluster the module's tests may stop, crash or restart."""
    private = PgCluster()
    yield private
    private.cleanup()


@pytest.fixture(params=["sqlite", "postgresql"])
def any_url(request: pytest.FixtureRequest) -> str:
    """A migrated database a test may break: a SQLite file, or one on the private cluster."""
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    return request.getfixturevalue("cluster").migrated_database()


@pytest.fixture(params=["postgresql", "sqlite"])
def engine(request: pytest.FixtureRequest) -> Engine:
    """The same test on both databases the product supports."""
    return request.getfixturevalue("pg_engine" if request.param == "postgresql" else "sqlite_engine")


@pytest.fixture(params=["postgresql", "sqlite"])
def blank_engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """An empty database of either kind, for a migration test to upgrade revision by revision."""
    url = request.getfixturevalue("fresh_db") if request.param == "postgresql" else f"sqlite:///{tmp_path / 'm.db'}"
    engine = make_engine(url)
    yield engine
    engine.dispose()


@pytest.fixture
def settings() -> Settings:
    """Settings for producer tests: loopback allowed, http allowed, a throwaway encryption key."""
    return loopback_producer(OUTBOX_ALLOWED_CIDRS="127.0.0.0/8,::1/128", OUTBOX_ENCRYPTION_KEY=THROWAWAY_KEY)


@pytest.fixture(params=["sealed", "plaintext"])
def report_settings(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    """Both ways a delivery report is stored: a sealed body is numbered statement by statement,
    a plaintext one (on PostgreSQL) in one statement (outbox/numbering.py)."""
    return settings if request.param == "sealed" else replace(settings, encryption_key=None)


@pytest.fixture
def seller_table(pg_engine: Engine, pg_url: str) -> Iterator[Engine]:
    """The seller's engine on PostgreSQL as a seller makes one (SQLAlchemy's and psycopg's
    defaults: a statement run five times is prepared), with the seller's own table: task 1,
    ``working``."""
    with pg_engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS seller_tasks (id int PRIMARY KEY, status text)")
        conn.exec_driver_sql("DELETE FROM seller_tasks")
        conn.exec_driver_sql("INSERT INTO seller_tasks VALUES (1, 'working')")
    engine = create_engine(pg_url)
    yield engine
    engine.dispose()
    with pg_engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE seller_tasks")


@pytest.fixture
def hooked(seller_table: Engine, settings: Settings) -> Engine:
    """The seller's engine after its first enqueue, which reads which columns the schema has
    and hooks the engine: one message stored."""
    with seller_table.begin() as conn:
        enqueue_task(conn, settings, task_id="first")
    return seller_table


@pytest.fixture
def refusing(seller_table: Engine) -> Iterator[Engine]:
    """The seller's engine while ``outbox_messages`` refuses tenant ``t_refused``: an INSERT
    failure nothing in the producer's validation can foresee."""
    with seller_table.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE outbox_messages ADD CONSTRAINT test_refuses_t_refused "
                             "CHECK (tenant_id <> 't_refused') NOT VALID")
    yield seller_table
    with seller_table.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE outbox_messages DROP CONSTRAINT test_refuses_t_refused")
