"""A real PgBouncer in transaction mode in front of the test PostgreSQL, started per test.

Debian's package (``/usr/sbin/pgbouncer``; ``.ci/run`` installs it). Its own ini and auth
file in a temporary directory, on a free loopback port; run as ``postgres`` when the tests
run as root (PgBouncer refuses root). A missing PgBouncer fails the test with one line,
never a silent skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url
from tests.procs import free_port

PGBOUNCER = "/usr/sbin/pgbouncer"


@dataclass(frozen=True)
class Bouncer:
    port: int
    log: Path

    def url(self, database_url: str) -> str:
        """``database_url`` (a database of the test server) reached through this PgBouncer."""
        return make_url(database_url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    def unlinked_packets(self) -> int:
        """Server messages PgBouncer got for no client (a NOTIFY for a LISTEN it pooled away)."""
        return self.log.read_text(errors="replace").count("when not linked")


@contextmanager
def pgbouncer(server_url: str, *, pool_size: int = 4, ignore_startup_parameters: str = "",
              max_client_conn: int = 500, query_timeout: float = 0) -> Iterator[Bouncer]:
    """PgBouncer with ``pool_mode = transaction`` and ``pool_size`` server connections per database
    (and, if given, the ``ignore_startup_parameters`` many installations set, a lower
    ``max_client_conn``, a ``query_timeout``)."""
    if not os.access(PGBOUNCER, os.X_OK):
        pytest.fail(f"PgBouncer is not installed ({PGBOUNCER}): apt-get install pgbouncer (.ci/run does)",
                    pytrace=False)
    server = make_url(server_url)
    directory = Path(tempfile.mkdtemp(prefix="outboxd-pgbouncer-"))
    port = free_port()
    (directory / "users.txt").write_text(f'"{server.username}" ""\n')
    (directory / "pgbouncer.ini").write_text(f"""\
[databases]
* = host={server.host} port={server.port or 5432}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {directory / 'users.txt'}
pool_mode = transaction
default_pool_size = {pool_size}
max_client_conn = {max_client_conn}
query_timeout = {query_timeout:g}
ignore_startup_parameters = {ignore_startup_parameters}
logfile = {directory / 'pgbouncer.log'}
pidfile = {directory / 'pgbouncer.pid'}
""")
    run_as: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres")
        for name in ("users.txt", "pgbouncer.ini"):
            shutil.chown(directory / name, "postgres")
        run_as = ["runuser", "-u", "postgres", "--"]
    proc = subprocess.Popen([*run_as, PGBOUNCER, str(directory / "pgbouncer.ini")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    bouncer = Bouncer(port, directory / "pgbouncer.log")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(bouncer.url(server_url), connect_timeout=3) as conn:
                    conn.execute("SELECT 1")
                break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log = bouncer.log.read_text(errors="replace")[-500:] if bouncer.log.exists() else ""
                    raise RuntimeError(f"PgBouncer did not start: {log}") from None
                time.sleep(0.1)
        yield bouncer
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(directory, ignore_errors=True)
