"""A database that stops answering without closing anything (a network black hole, a stuck
pooler): the daemon's statements time out, the outage guard counts them, and the daemon
exits non-zero within its bound instead of hanging a claim or a flush for ever.

The black hole is a loopback TCP proxy in this process that, once stalled, still accepts
connections and reads what it is sent (so the client's kernel sees every byte acknowledged)
but forwards nothing either way: neither TCP keepalives nor the TCP user timeout notice it,
only the client's own statement deadline does.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.engine import make_url

from tests import procs
from tests.test_db_faults import _exit_line, all_finished, check_ledger, daemon_events, enqueue_batch, message_key


class StallingProxy:
    """Forwards 127.0.0.1:<port> to ``target`` until :meth:`stall`, then swallows everything."""

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.stalled = threading.Event()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self) -> None:
        self.stalled.set()

    def close(self) -> None:
        self._closed.set()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._sockets.append(client)
            if self.stalled.is_set():  # accepted, never answered
                threading.Thread(target=self._swallow, args=(client,), daemon=True).start()
                continue
            server = socket.create_connection(self._target)
            self._sockets.append(server)
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _swallow(self, src: socket.socket) -> None:
        try:
            while src.recv(65536):
                pass
        except OSError:
            pass

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if self.stalled.is_set():
                    self._swallow(src)
                    return
                dst.sendall(data)
        except OSError:
            pass


@contextmanager
def stalling_proxy(url: str, kind: type[StallingProxy] = StallingProxy) -> Iterator[tuple[StallingProxy, str]]:
    """A ``kind`` of proxy to ``url``'s server, and ``url`` through it."""
    parsed = make_url(url)
    proxy = kind((parsed.host or "127.0.0.1", parsed.port or 5432))
    try:
        yield proxy, parsed.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    finally:
        proxy.close()


def test_a_black_holed_database_trips_the_outage_guard_within_its_bound(pg_engine, pg_url, tmp_path):
    key, jwks = procs.make_key(tmp_path)
    timeout, outage = 2, 5
    with procs.receiver(tmp_path, jwks, verifier="library") as (port, arrivals_log), \
            stalling_proxy(pg_url) as (proxy, proxied):
        base = f"http://127.0.0.1:{port}/ok"
        env = procs.daemon_env(proxied, key, database_statement_timeout_seconds=timeout,
                               database_outage_seconds=outage)
        log = tmp_path / "through-proxy.log"
        daemon = procs.start_daemon(env, log)
        try:
            enqueue_batch(pg_engine, [("t1", base, message_key("bh", i)) for i in range(5)])
            assert procs.wait_until(lambda: all_finished(pg_engine, 5), 40), daemon_events(log)[-3:]
            proxy.stall()
            stalled_at = time.monotonic()
            enqueue_batch(pg_engine, [("t1", base, message_key("bh", i)) for i in range(5, 10)])
            # A claim or flush fails after the statement timeout; reconnecting fails after the
            # connect timeout; past the outage deadline the daemon exits (the driver gives up on
            # its other statements within 10 s). Generous on a busy machine, and finite.
            assert daemon.wait(timeout + 10 + outage + 40) != 0
            elapsed = time.monotonic() - stalled_at
        finally:
            procs.stop(daemon)
        causes = {e.get("cause") for e in daemon_events(log) if e.get("event") == "database.error"}
        assert causes & {"timeout", "connection"}, causes
        assert "database unreachable for" in _exit_line(log) or "statement timed out" in _exit_line(log)
        print(f"\nblack hole: the daemon exited {elapsed:.1f} s after the database stopped answering "
              f"(statement timeout {timeout} s, outage bound {outage} s)")
        # Nothing was lost: a daemon on a working connection finishes the rest.
        daemon = procs.start_daemon(procs.daemon_env(pg_url, key), tmp_path / "direct.log")
        try:
            assert procs.wait_until(lambda: all_finished(pg_engine, 10), 60)
        finally:
            procs.stop(daemon)
        summary = check_ledger(pg_engine, [arrivals_log])
        assert summary["delivered"] == 10, summary
