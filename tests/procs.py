"""Real processes for end-to-end tests: the daemon (``outboxd run``) and the receiver.

Both run as subprocesses of the test, on 127.0.0.1, and are killed for real (SIGKILL)
when a test wants to prove that nothing is lost.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from supervisor.wire.signing import generate_signing_key_pem, load_signing_key

KEY_ID = "e2e-key"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_key(directory: Path, alg: str = "ed25519") -> tuple[Path, Path]:
    """A signing key PEM and the matching public JWKS file."""
    pem = directory / "signing-key.pem"
    pem.write_bytes(generate_signing_key_pem(alg))
    jwks = directory / "jwks.json"
    jwks.write_text(json.dumps({"keys": [load_signing_key(pem, KEY_ID).public_jwk()]}))
    return pem, jwks


def daemon_env(database_url: str, key: Path, **extra: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update({
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_SIGNING_KEY_FILE": str(key),
        "OUTBOX_SIGNING_KEY_ID": KEY_ID,
        "OUTBOX_ALLOW_HTTP": "true",
        "OUTBOX_ALLOWED_CIDRS": "127.0.0.0/8",
        "OUTBOX_LOG_FORMAT": "json",
        "OUTBOX_CONNECT_TIMEOUT_SECONDS": "2",
        "OUTBOX_READ_TIMEOUT_SECONDS": "2",
        "OUTBOX_LEASE_SECONDS": "5",
        "OUTBOX_RETRY_BASE_SECONDS": "0.5",
        "OUTBOX_RETRY_MAX_SECONDS": "5",
        "OUTBOX_POLL_INTERVAL_SECONDS": "0.5",
        "OUTBOX_SHUTDOWN_GRACE_SECONDS": "3",
    })
    env.update({f"OUTBOX_{k.upper()}": str(v) for k, v in extra.items()})
    return env


# What daemon_env shortens to keep other tests quick: a test of the defaults drops them.
SHORTENED = ("CONNECT_TIMEOUT_SECONDS", "READ_TIMEOUT_SECONDS", "LEASE_SECONDS", "RETRY_BASE_SECONDS",
             "RETRY_MAX_SECONDS", "POLL_INTERVAL_SECONDS", "SHUTDOWN_GRACE_SECONDS")


def default_daemon_env(database_url: str, key: Path, **extra: Any) -> dict[str, str]:
    """:func:`daemon_env` with the daemon's own defaults for every timing it shortens (plain
    HTTP to loopback receivers, JSON logs and the test key stay)."""
    env = daemon_env(database_url, key, **extra)
    for name in SHORTENED:
        if name.lower() not in extra:
            del env[f"OUTBOX_{name}"]
    return env


def start_daemon(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    handle = open(log, "ab")
    return subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run"], env=env, stdout=handle,
                            stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 20) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout)


def stop_timed(proc: subprocess.Popen[bytes], timeout: float = 90) -> tuple[int, float]:
    """SIGTERM ``proc``: its exit status and how many seconds after SIGTERM it came (killed
    if it is still running after ``timeout``)."""
    told = time.monotonic()
    try:
        return stop(proc, timeout=timeout), time.monotonic() - told
    finally:
        if proc.poll() is None:
            proc.kill()


_forks: subprocess.Popen[str] | None = None


def _fork_receiver(args: Sequence[str]) -> int:
    """Start ``python -m outboxd_receiver ARGS`` as a child of the fork server; its pid."""
    global _forks
    if _forks is None or _forks.poll() is not None:
        _forks = subprocess.Popen([sys.executable, "-m", "tests.receiver_forks"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
        atexit.register(_forks.kill)
    assert _forks.stdin is not None and _forks.stdout is not None
    _forks.stdin.write(json.dumps({"argv": list(args)}) + "\n")
    _forks.stdin.flush()
    return int(json.loads(_forks.stdout.readline())["pid"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextmanager
def receiver(directory: Path, jwks: Path | None, *, verifier: str = "adcp", name: str = "receiver",
             extra: Sequence[str] = (), log_bodies: bool = False) -> Iterator[tuple[int, Path]]:
    """A receiver process (forked by ``tests/receiver_forks.py``); yields (port, arrivals JSONL file)."""
    port_file, log = directory / f"{name}.port", directory / f"{name}.jsonl"
    args = ["--port-file", str(port_file), "--log", str(log),
            "--verifier", verifier, *extra, *(["--log-bodies"] if log_bodies else [])]
    if jwks is not None:
        args += ["--jwks", str(jwks)]
    pid = _fork_receiver(args)
    try:
        deadline = time.monotonic() + 90  # the first one waits for the fork server's adcp import
        while not port_file.exists():
            if not _alive(pid) or time.monotonic() > deadline:
                raise RuntimeError("receiver did not start")
            time.sleep(0.05)
        log.touch()
        yield int(port_file.read_text()), log
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a JSON-lines file another process may be appending to: a line
    being written can be seen half written, so the unterminated tail waits for the next read."""
    text = path.read_text()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]


arrivals = json_lines  # the receiver's arrivals so far: its log, read while it appends


def wait_until(predicate: Any, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def outboxd(env: dict[str, str], *args: str, exit_code: int | None = None) -> subprocess.CompletedProcess[str]:
    """Run one ``outboxd`` command to its end (text output captured); with ``exit_code``,
    assert that it exited so (its stderr in the failure)."""
    done = subprocess.run([sys.executable, "-m", "supervisor.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)
    assert exit_code is None or done.returncode == exit_code, (args, done.returncode, done.stderr)
    return done


def readyz(port: int) -> tuple[int, str]:
    """The daemon's ``/readyz`` on its metrics ``port``: (status, body); (0, why) when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:  # not listening (yet, or any more)
        return 0, str(exc)


def start_ui(env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    """``outboxd ui`` on 127.0.0.1:``port``; returns once it accepts connections."""
    env = {**env, "OUTBOX_UI_ADDR": f"127.0.0.1:{port}"}
    proc = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "ui"], env=env, stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT)

    def accepting() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return True
        except OSError:
            return proc.poll() is not None

    if not wait_until(accepting, 60) or proc.poll() is not None:
        proc.kill()
        raise RuntimeError(f"outboxd ui did not start: {log.read_text()[-500:]}")
    return proc
