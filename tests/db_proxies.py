"""Loopback TCP proxies in front of PostgreSQL, for tests that need to see or break the wire.

:class:`StallingProxy` forwards until told to stall, then accepts and reads everything and
forwards nothing (a network black hole, a stuck pooler): neither TCP keepalives nor the TCP
user timeout notice it, only a client's own deadline does. :class:`CommitSwallowingProxy`
stalls by itself at the ``COMMIT`` of a client's first transaction that updated something,
which it never forwards: the server is left inside the transaction.
:class:`TurnCountingProxy` counts how many times a client waited for an answer (its round
trips).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy.engine import make_url


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
        """Close every socket, shutting it down first: a socket closed while a pump thread
        waits in ``recv`` on it stays open until that ``recv`` returns, so the server would
        keep the session (and any locks of its open transaction) after the proxy is gone."""
        self._closed.set()
        for s in self._sockets:
            for end in (lambda: s.shutdown(socket.SHUT_RDWR), s.close):
                try:
                    end()
                except OSError:
                    pass

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._sockets.append(client)
            self._serve(client)

    def _serve(self, client: socket.socket) -> None:
        """Start forwarding what ``client`` and the server send each other (a subclass may
        forward otherwise)."""
        if self.stalled.is_set():  # accepted, never answered
            threading.Thread(target=self._swallow, args=(client,), daemon=True).start()
            return
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
        watch = self._watcher(upstream=src.getpeername()[1] != self._target[1])
        try:
            while data := src.recv(65536):
                watch(data)
                if self.stalled.is_set():
                    self._swallow(src)
                    return
                dst.sendall(data)
        except OSError:
            pass

    def _watcher(self, upstream: bool) -> Callable[[bytes], None]:
        """What looks at each chunk one direction of a connection forwards (``upstream``:
        the client's), before it is forwarded; a subclass's may stall the proxy."""
        return lambda data: None


@contextmanager
def stalling_proxy(url: str, kind: type[StallingProxy] = StallingProxy) -> Iterator[tuple[StallingProxy, str]]:
    """A ``kind`` of proxy to ``url``'s server, and ``url`` through it."""
    parsed = make_url(url)
    proxy = kind((parsed.host or "127.0.0.1", parsed.port or 5432))
    try:
        yield proxy, parsed.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    finally:
        proxy.close()


class CommitSwallowingProxy(StallingProxy):
    """Forwards as :class:`StallingProxy` does until a client commits a transaction that
    updated or inserted something: then it stalls, that ``COMMIT`` included, as a black hole
    that opened between a transaction's last statement and its commit."""

    def _watcher(self, upstream: bool) -> Callable[[bytes], None]:
        wrote = False

        def watch(data: bytes) -> None:
            nonlocal wrote
            wrote = wrote or (upstream and (b"UPDATE " in data or b"INSERT " in data))
            if wrote and b"COMMIT\x00" in data:  # the statement's text, as the protocol ends it
                self.stall()

        return watch


class TurnCountingProxy(StallingProxy):
    """Forwards as :class:`StallingProxy` does and counts the client's turns: each time it
    sends after the server last did, it has waited for an answer (a round trip)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.turns = 0
        self._last = ""
        self._lock = threading.Lock()
        super().__init__(target)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        src.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        upstream = src.getpeername()[1] != self._target[1]
        try:
            while data := src.recv(65536):
                with self._lock:
                    if upstream and self._last != "up":
                        self.turns += 1
                    self._last = "up" if upstream else "down"
                dst.sendall(data)
        except OSError:
            pass


class CommitAnswerCuttingProxy(StallingProxy):
    """Forwards as :class:`StallingProxy` does until :meth:`arm`; then, once a client has sent
    a ``COMMIT``, the server's answer that completes it is not forwarded and that client's
    connection is cut: the server committed, the client never hears so (an ambiguous commit)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.armed = threading.Event()
        self.cut = threading.Event()
        super().__init__(target)

    def arm(self) -> None:
        self.armed.set()

    def _serve(self, client: socket.socket) -> None:
        server = socket.create_connection(self._target)
        self._sockets.append(server)
        committing = threading.Event()
        threading.Thread(target=self._up, args=(client, server, committing), daemon=True).start()
        threading.Thread(target=self._down, args=(server, client, committing), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, committing: threading.Event) -> None:
        try:
            while data := client.recv(65536):
                if self.armed.is_set() and b"COMMIT\x00" in data:
                    committing.set()
                server.sendall(data)
        except OSError:
            pass

    def _down(self, server: socket.socket, client: socket.socket, committing: threading.Event) -> None:
        try:
            while data := server.recv(65536):
                if committing.is_set() and b"COMMIT\x00" in data:  # the COMMIT's CommandComplete
                    self.armed.clear()
                    self.cut.set()
                    client.shutdown(socket.SHUT_RDWR)
                    client.close()
                    return
                client.sendall(data)
        except OSError:
            pass
