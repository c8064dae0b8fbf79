"""Find a PostgreSQL server for the tests, or start a throwaway one.

Order: ``OUTBOX_TEST_PG_URL``; the local server on 127.0.0.1:5432 (trust auth, user
``postgres``); a temporary cluster started with the PostgreSQL binaries on this machine.
When none works the suite fails with one line saying why — never a silent skip.
"""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time

import psycopg

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


def _reachable(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    return candidates[0] if candidates else None


def run_as_postgres() -> list[str]:
    """The command prefix that runs initdb, pg_ctl and postgres as ``postgres`` (they refuse root).

    ``runuser`` lives in ``/usr/sbin`` on Debian, which a non-login root shell may not have
    on ``PATH``, so the system directories are searched too.
    """
    if os.geteuid() != 0:
        return []
    found = shutil.which("runuser") or shutil.which("runuser", path="/usr/sbin:/sbin:/usr/bin:/bin")
    if found is None:
        raise RuntimeError("running as root needs `runuser` (util-linux) to start PostgreSQL as postgres")
    return [found, "-u", "postgres", "--"]


def _start_throwaway() -> str:
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        raise RuntimeError(
            "no PostgreSQL reachable at 127.0.0.1:5432 and no PostgreSQL binaries (initdb, pg_ctl) "
            "to start one: install postgresql or set OUTBOX_TEST_PG_URL"
        )
    datadir = tempfile.mkdtemp(prefix="outboxd-pg-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_as = run_as_postgres()
    if run_as:
        shutil.chown(datadir, "postgres")
    subprocess.run([*run_as, initdb, "-D", datadir, "-U", "postgres", "--auth=trust"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run([*run_as, pg_ctl, "-D", datadir, "-w", "-l", os.path.join(datadir, "log"),
                    "-o", f"-p {port} -k {datadir} -c listen_addresses=127.0.0.1", "start"],
                   check=True, stdout=subprocess.DEVNULL)
    atexit.register(lambda: subprocess.run([*run_as, pg_ctl, "-D", datadir, "-m", "immediate", "stop"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    deadline = time.monotonic() + 30
    while not _reachable(url):
        if time.monotonic() > deadline:
            raise RuntimeError(f"started a throwaway PostgreSQL in {datadir} but it never answered")
        time.sleep(0.2)
    return url


def server_url() -> str:
    """A superuser URL (database ``postgres``) of a reachable server."""
    url = os.environ.get("OUTBOX_TEST_PG_URL")
    if url:
        if not _reachable(url):
            raise RuntimeError(f"OUTBOX_TEST_PG_URL={url} is not reachable")
        return url
    if _reachable(DEFAULT_URL):
        return DEFAULT_URL
    return _start_throwaway()
