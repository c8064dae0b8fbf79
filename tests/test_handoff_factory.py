"""Loading the reporting hand-off's factory (``OUTBOX_REPORTING_HANDOFF``, docs/reporting.md).

The factory's module (the seller's, importing the SDK) is imported while the daemon already
delivers: a stop during that import must not wait for it, and a factory that cannot be
loaded or returns the wrong thing is a one-line configuration error.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from outbox.config import Settings
from outbox.errors import ConfigurationError
from supervisor.cycle.reporting_handoff import build_handoffs, close_all
from tests import procs
from tests.reporting_world import EXAMPLES, KEY, with_example_handoff


def _factory_module(where: Path, name: str, body: str) -> None:
    (where / f"{name}.py").write_text(body)


def _env(sqlite_url: str, tmp_path: Path, handoff: str) -> dict[str, str]:
    key, _ = procs.make_key(tmp_path)
    env = procs.default_daemon_env(sqlite_url, key, reporting_handoff=handoff)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    return env


def test_sigterm_while_the_factory_is_still_importing_stops_at_once(sqlite_url, tmp_path):
    """The import runs beside delivery, on a thread the stop does not wait for: a module that
    takes a minute to import (a seller's SDK on a busy box takes ten seconds and more) does
    not hold a SIGTERM for that minute."""
    _factory_module(tmp_path, "slow_factory", "import time\ntime.sleep(60)\n\ndef build(settings):\n    return []\n")
    log = tmp_path / "daemon.log"
    daemon = procs.start_daemon(_env(sqlite_url, tmp_path, "slow_factory:build"), log)
    assert procs.wait_until(lambda: "daemon.started" in log.read_text(), 60), log.read_text()[-2000:]
    rc, took = procs.stop_timed(daemon, timeout=30)
    print(f"\nSIGTERM while the hand-off's factory imports: exit {rc} after {took:.1f} s")
    assert rc == 0 and took < 5, f"exit {rc} after {took:.1f} s"


def test_a_stop_after_the_sdk_is_imported_does_not_wait_for_the_interpreter_teardown(sdk_queues, tmp_path):
    """With the seller's SDK imported (the example factory, ``docs/examples``), Python's
    own teardown collected its objects for 2-5 s after the daemon had closed everything;
    ``outboxd run`` leaves without it, so an idle daemon's stop takes well under a second."""
    metrics_port = procs.free_port()
    key, _ = procs.make_key(tmp_path)
    env = with_example_handoff(procs.default_daemon_env(sdk_queues, key, encryption_key=KEY,
                                                        metrics_addr=f"127.0.0.1:{metrics_port}"))
    log = tmp_path / "daemon.log"
    daemon = procs.start_daemon(env, log)
    try:
        # The hand-off has run a turn (it sets the backlog gauge): the SDK is imported.
        assert procs.wait_until(lambda: "outbox_reporting_handoff_backlog{" in _metrics(metrics_port), 120), \
            log.read_text()[-2000:]
    finally:
        rc, took = procs.stop_timed(daemon, timeout=30)
    print(f"\nSIGTERM to an idle daemon with the SDK imported: exit {rc} after {took:.2f} s")
    assert rc == 0 and took < 1.0, f"exit {rc} after {took:.2f} s"


def _metrics(port: int) -> str:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics").text
    except httpx.HTTPError:  # not listening yet
        return ""


def test_a_factory_that_fails_to_import_stops_the_daemon_with_one_line(sqlite_url, tmp_path):
    _factory_module(tmp_path, "broken_factory", "import no_such_package_here\n")
    run = subprocess.run([sys.executable, "-m", "supervisor.cli", "run"], capture_output=True, text=True, timeout=60,
                         env=_env(sqlite_url, tmp_path, "broken_factory:build"))
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1, run.stderr[-2000:]
    assert last == ("outboxd run: OUTBOX_REPORTING_HANDOFF 'broken_factory:build' cannot be loaded: "
                    "No module named 'no_such_package_here'"), last


@pytest.mark.parametrize(("path", "module", "said"), [
    ("no_colon", None, "must be written package.module:factory"),
    (":build", None, "must be written package.module:factory"),
    ("absent_module_xyz:build", None, "cannot be loaded: No module named 'absent_module_xyz'"),
    ("plain_factory:missing", "def build(settings):\n    return []\n", "cannot be loaded"),
    ("plain_factory:build", "def build(settings):\n    return []\n", "returned list, not an outbox.reporting"),
    ("plain_factory:build", "async def build(settings):\n    return 'x'\n", "returned str, not an outbox.reporting"),
    ("plain_factory:build", "import os\ndef build(settings):\n    return os.environ['UNSET_SELLER_DSN_XYZ']\n",
     "failed: KeyError: 'UNSET_SELLER_DSN_XYZ'"),
    ("json:dumps", None, "failed: TypeError: Object of type Settings is not JSON serializable"),
])
def test_a_factory_that_cannot_be_used_is_a_configuration_error(tmp_path, monkeypatch, path, module, said):
    if module is not None:
        _factory_module(tmp_path, "plain_factory", module)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "plain_factory", raising=False)
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'unused.db'}", reporting_handoff=path)
    with pytest.raises(ConfigurationError, match=said):
        asyncio.run(build_handoffs(settings))


def test_the_example_factorys_connections_give_up_on_a_server_that_stopped_answering(tmp_path, monkeypatch):
    """The example hand-off's own engine (``docs/examples``) connects with the daemon's bounds:
    to a server that accepts and never answers (the address a failover left silent) it fails
    within the default statement timeout, 15 s, and the next turn connects afresh. Without
    them the connect waited for the operating system, the turn with it, and reporting
    stopped while delivery went on."""
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel completes the handshake; no one answers
    monkeypatch.syspath_prepend(str(EXAMPLES))
    for name, value in with_example_handoff({}).items():
        if name.startswith("REPORTING_"):
            monkeypatch.setenv(name, value)
    from reporting_handoff import build

    settings = Settings(database_url=f"postgresql://outboxd@127.0.0.1:{silent.getsockname()[1]}/outboxd")

    async def connect_once() -> tuple[BaseException | None, float]:
        handoffs = await build(settings)
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.to_thread(lambda: handoffs[0].engine.connect().close()), 40)
            return None, time.monotonic() - started
        except Exception as exc:  # noqa: BLE001 - the outcome is what is asserted
            return exc, time.monotonic() - started
        finally:
            silent.close()  # frees a connect still waiting, and the pool's own attempts
            await close_all(handoffs)

    error, took = asyncio.run(connect_once())
    print(f"\nthe example's engine gave up on a silent server after {took:.1f} s: {type(error).__name__}")
    assert error is not None and not isinstance(error, TimeoutError), f"{error!r} after {took:.1f} s"
    assert took < 20, f"gave up after {took:.1f} s"
