"""Peers and senders on 127.0.0.1 for the tests of the daemon's HTTP sender.

Every peer is a small asyncio server, so each test controls the exact bytes (and resets,
stalls, garbage) a hostile receiver can produce. Nothing ever leaves loopback: the
``connects`` guard refuses (and records) any TCP connect to another address. A test module
takes the fixtures it needs by importing them (``event_loop_policy`` runs its tests on
asyncio's loop and on uvloop's; ``connects`` applies itself to every test of a module that
imports it).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from outbox.config import Settings
from supervisor.wire.transport import HttpSender

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)
BODY = b'{"idempotency_key":"whk_0123456789abcdef"}'
HEADERS = {"Content-Type": "application/json"}


# --------------------------------------------------------------------------- loops


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    """Every test on asyncio's loop and on uvloop's, which the daemon runs on (their
    transports differ: uvloop's are not ``asyncio.Transport`` subclasses)."""
    if request.param == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.EventLoopPolicy()
    return asyncio.DefaultEventLoopPolicy()


# --------------------------------------------------------------------------- guard


@pytest.fixture(autouse=True)
def connects(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every address a socket connected to; a non-loopback one is refused outright.

    The guard sits on ``socket.socket.connect``, below the sender: whatever path a connection
    takes, a host name or a private address here would be a second, unvetted resolution.
    """
    seen: list[str] = []
    real = socket.socket.connect

    def guarded(sock: socket.socket, address) -> None:  # type: ignore[no-untyped-def]
        host = str(address[0])
        seen.append(host)
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise OSError("test guard: only loopback IP addresses may be contacted")
        return real(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    return seen


# --------------------------------------------------------------------------- peer


@dataclass
class Request:
    """One request as the peer read it."""
    line: str
    headers: dict[str, str]
    body: bytes


Handler = Callable[[Request, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


@dataclass
class Peer:
    """An HTTP/1.1-ish server on 127.0.0.1 whose answers are written by ``handler``.

    The handler returns True to keep the connection open for another request.
    """

    handler: Handler
    ssl_context: ssl.SSLContext | None = None
    connections: int = 0
    requests: list[Request] = field(default_factory=list)
    port: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> Peer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.ssl_context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                line, *lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in lines if h)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                request = Request(line, headers, body)
                self.requests.append(request)
                if not await self.handler(request, reader, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._tasks.discard(task)
            writer.close()


def response(status: int, body: bytes = b"ok", extra: str = "", reason: str = "X") -> bytes:
    """The bytes of an HTTP/1.1 answer with a Content-Length."""
    return f"HTTP/1.1 {status} {reason}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


async def ok(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Answer 200 and keep the connection open."""
    writer.write(response(200, b'{"ok":true}', reason="OK"))
    await writer.drain()
    return True


@pytest.fixture
async def peers():  # type: ignore[no-untyped-def]
    """Start peers (``await peers(handler)``); all stopped after the test."""
    started: list[Peer] = []

    async def start(handler: Handler = ok, ssl_context: ssl.SSLContext | None = None) -> Peer:
        peer = await Peer(handler, ssl_context).start()
        started.append(peer)
        return peer

    yield start
    for peer in started:
        await peer.stop()


#: Timeouts short enough that a test can wait for one to fire; only the tests that time a
#: hostile receiver's stall use them, so a loaded box cannot turn an ordinary POST into one.
IMPATIENT = {"connect_timeout_seconds": 0.5, "read_timeout_seconds": 0.5}


def loopback_settings(**kw: object) -> Settings:
    """Settings that let a sender reach plain-HTTP peers on loopback.

    The default timeouts stay roomy (a TLS handshake on a box shared with the rest of the
    suite may take a second); a test of a stall passes ``**IMPATIENT``.
    """
    base: dict[str, object] = dict(
        allow_http=True, allowed_cidrs=LOOPBACK, connect_timeout_seconds=5.0, read_timeout_seconds=5.0
    )
    base.update(kw)
    return Settings(**base)  # type: ignore[arg-type]


@pytest.fixture
async def senders():  # type: ignore[no-untyped-def]
    """Make senders (``senders(settings, **kw)``); all closed after the test."""
    made: list[HttpSender] = []

    def make(s: Settings | None = None, **kw: object) -> HttpSender:
        sender = HttpSender(s or loopback_settings(), **kw)  # type: ignore[arg-type]
        made.append(sender)
        return sender

    yield make
    for sender in made:
        await sender.aclose()


# --------------------------------------------------------------------------- hostile receivers


async def never_answers(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Read the request and say nothing, for an hour."""
    await asyncio.sleep(3600)
    return False


async def resets(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Close with a TCP reset instead of an answer."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()  # close with linger 0: the kernel sends RST
    return False


async def answers_late(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Answer 200 after 1.5 s (past an impatient sender's read timeout)."""
    await asyncio.sleep(1.5)
    return await ok(request, reader, writer)


async def answers_garbage(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Answer with bytes that are not HTTP."""
    writer.write(b"SSH-2.0-OpenSSH_9.6 totally not http\r\n\r\n")
    await writer.drain()
    return False


async def sends_half_a_body(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Promise 1,000 bytes of body, send 100, close."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 100)
    await writer.drain()
    return False


async def hangs_up(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Close without answering."""
    return False


async def trickles(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Send a head, then the body a byte every 0.2 s: each read in time, the whole never."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    while True:  # one byte per 0.2 s: each read is within the read timeout, forever
        writer.write(b"x")
        await writer.drain()
        await asyncio.sleep(0.2)
