"""The signing-key rotation runbooks of docs/operations.md, walked against a real daemon.

Each platform puts key files somewhere else (a Secret volume, a systemd credential
directory, a bind mount); the keyring records the path a key is staged with. For each
platform the test lays a directory out as that platform does, takes the staging command
from the runbook itself, maps its path onto that directory, stages and promotes, and has a
receiver verify (with the adcp SDK, against the JWKS the daemon serves) that the next
webhook is signed by the new key.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from outbox.db import make_engine
from outbox.migrate import upgrade
from tests import procs
from tests.ledger import enqueue_many
from tests.procs import free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent
RUNBOOK = (ROOT / "docs" / "operations.md").read_text()
STAGE = re.compile(r"outboxd keys rotate --key-file (\S+) --kid (\S+)`")

# platform: (runbook section, where the daemon reads keys, how a file NAME appears there, restart needed)
PLATFORMS = {
    "kubernetes": ("### Kubernetes", "/etc/outboxd/keys", "{}", False),
    "systemd": ("### systemd", "/run/credentials/outboxd.service", "keys_{}", True),
    "compose": ("### Docker Compose", "/run/outboxd/keys", "{}", False),
}


def section(heading: str) -> str:
    start = RUNBOOK.index(heading + "\n")
    end = RUNBOOK.find("\n##", start + len(heading))
    return RUNBOOK[start:end if end != -1 else None]


def start(env: dict[str, str], jwks_url: str, log: Path) -> subprocess.Popen[bytes]:
    """A daemon, once it serves its JWKS (it has read the keyring and set up its signals)."""
    daemon = procs.start_daemon(env, log)

    def serving() -> bool:
        try:
            urllib.request.urlopen(jwks_url, timeout=2).close()
            return True
        except OSError:
            return False

    assert procs.wait_until(serving, 60), log.read_text()[-2000:]
    return daemon


@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_rotation_runbook_signs_with_the_new_key(platform, tmp_path):
    heading, mount, appears_as, restart = PLATFORMS[platform]
    steps = section(heading)
    [(staged_path, kid)] = STAGE.findall(steps)
    assert staged_path.startswith(mount + "/") and "outboxd keys promote" in steps
    source, mounted = tmp_path / "source", tmp_path / "mounted"  # the operator's copy; what the daemon sees
    source.mkdir()
    mounted.mkdir()

    def publish(name: str) -> None:
        """What the platform does with a key file the operator added (Secret, credential, bind mount)."""
        shutil.copy2(source / name, mounted / appears_as.format(name))

    first, _ = procs.make_key(source)
    publish(first.name)
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    upgrade(make_engine(url))
    port = free_port()
    env = procs.daemon_env(url, mounted / appears_as.format(first.name), metrics_addr=f"127.0.0.1:{port}",
                           key_cache_window_seconds=0)  # the wait is the buyers' cache, not under test
    jwks_url = f"http://127.0.0.1:{port}/.well-known/jwks.json"
    with procs.receiver(tmp_path, None, extra=["--jwks-url", jwks_url]) as (receiver_port, log):
        daemon = start(env, jwks_url, tmp_path / "daemon.log")
        try:
            procs.outboxd(env, "keys", "generate", "--out", str(source / "k2.pem"), exit_code=0)
            publish("k2.pem")
            if restart:  # systemd loads credentials at start
                assert procs.stop(daemon) == 0
                daemon = start(env, jwks_url, tmp_path / "daemon.log")
            here = str(mounted / Path(staged_path).relative_to(mount))
            procs.outboxd(env, "keys", "rotate", "--key-file", here, "--kid", kid, exit_code=0)
            procs.outboxd(env, "keys", "promote", exit_code=0)
            # A promotion takes effect one second after it commits, on every replica at once.
            assert procs.wait_until(lambda: re.search(rf"^{kid}\s+\(default\)\s+active\b",
                                                      procs.outboxd(env, "keys", "list", exit_code=0).stdout, re.M), 30)
            engine = make_engine(url)
            [key] = enqueue_many(engine, f"http://127.0.0.1:{receiver_port}", ["/ok"])
            assert procs.wait_until(lambda: any(a["key"] == key for a in procs.arrivals(log)), 60), \
                (tmp_path / "daemon.log").read_text()[-2000:]
        finally:
            procs.stop(daemon)
    [arrival] = [a for a in procs.arrivals(log) if a["key"] == key]
    assert arrival["verified"] and arrival["keyid"] == kid, arrival
