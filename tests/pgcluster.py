"""A private, throwaway PostgreSQL cluster that a test may stop, restart or kill at will.

Tests that take the database away from the daemon must never touch the machine's shared
server, so they start their own: ``initdb`` into a temporary directory, ``pg_ctl`` on a
free loopback port (as the ``postgres`` user when running as root, since initdb refuses
root), and everything is stopped and deleted at interpreter exit even if a test fails.
The port stays the same across restarts, so a daemon's ``OUTBOX_DATABASE_URL`` stays valid.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
import time
import uuid

import psycopg

from outbox.db import make_engine
from outbox.migrate import upgrade
from tests.pgserver import _pg_bin, run_as_postgres
from tests.procs import free_port


class PgCluster:
    """One private cluster: :meth:`start`, :meth:`stop`, :meth:`restart`, :meth:`cleanup`."""

    def __init__(self, *, fast: bool = True) -> None:
        initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
        if not (initdb and pg_ctl):
            raise RuntimeError("PostgreSQL binaries (initdb, pg_ctl) are needed for a private cluster")
        self._initdb, self._pg_ctl = initdb, pg_ctl
        self.datadir = tempfile.mkdtemp(prefix="outboxd-pgcluster-")
        self.port = free_port()
        self._run_as = run_as_postgres()
        if self._run_as:
            shutil.chown(self.datadir, "postgres")
        subprocess.run([*self._run_as, initdb, "-D", self.datadir, "-U", "postgres", "--auth=trust",
                        "--no-sync"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        options = [f"-p {self.port}", f"-k {self.datadir}", "-c listen_addresses=127.0.0.1",
                   "-c max_connections=200"]
        if fast:
            # Durability against an OS crash buys nothing for a throwaway cluster, but a
            # PostgreSQL crash (``stop("immediate")``) must not lose acknowledged commits:
            # WAL still reaches the OS at commit (no synchronous_commit=off).
            options += ["-c fsync=off", "-c full_page_writes=off"]
        self._options = " ".join(options)
        self._cleaned = False
        atexit.register(self.cleanup)
        self.start()

    @property
    def server_url(self) -> str:
        return self.url("postgres")

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([*self._run_as, self._pg_ctl, "-D", self.datadir, *args], check=check,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def is_running(self) -> bool:
        return self._ctl("status", check=False).returncode == 0

    def reachable(self) -> bool:
        try:
            with psycopg.connect(self.server_url, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False

    def start(self, timeout: float = 30) -> None:
        self._ctl("-w", "-t", str(int(timeout)), "-l", os.path.join(self.datadir, "log"), "-o", self._options,
                  "start")
        deadline = time.monotonic() + timeout
        while not self.reachable():
            if time.monotonic() > deadline:
                raise RuntimeError(f"private PostgreSQL in {self.datadir} never answered")
            time.sleep(0.1)

    def stop(self, mode: str = "fast") -> None:
        """``fast`` ends sessions and shuts down cleanly; ``immediate`` is a crash."""
        self._ctl("-w", "-m", mode, "stop")

    def restart(self, mode: str = "fast", down_seconds: float = 0.0) -> None:
        self.stop(mode)
        if down_seconds:
            time.sleep(down_seconds)
        self.start()

    def create_database(self, prefix: str = "outboxd") -> str:
        """A new empty database; returns its URL."""
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(self.server_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def migrated_database(self) -> str:
        """A new database with the outbox schema; returns its URL."""
        url = self.create_database()
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        return url

    def cleanup(self) -> None:
        if self._cleaned:
            return
        self._cleaned = True
        if self.is_running():
            self._ctl("-m", "immediate", "stop", check=False)
        shutil.rmtree(self.datadir, ignore_errors=True)
