"""One HTTP/1.1 client connection on the event loop's own transport: the daemon's wire.

The daemon sends one kind of request: a POST of stored bytes to a canonical URL. From the
answer it needs the status, the headers and at most 64 KiB of body. A general-purpose
client costs far more than that needs: on the bench box, httpx spent 0.56 ms of CPU per
HTTPS request where this connection spends about 0.02 ms (docs/performance.md, "The HTTP
client"). So the daemon owns its HTTP/1.1 exchange, and the hard parts stay in
well-tested code: responses are parsed by llhttp (through ``httptools``, the parser
uvicorn uses), and TLS is the event loop's (``ssl`` objects, certificate and host name
checked by the context).

What owning the wire buys besides speed:

* **The signed target is the sent target, by construction.** The request line and
  ``Host`` are written from the canonical URL's own characters (:func:`encode_request`);
  no client re-encodes a path or query after the signature was made.
* **Nothing is read that is not needed.** A response body past the cap is never read:
  the connection is dropped (docs/protocol.md "Sizes and timeouts").
* **Nothing is read as an answer that is not one.** A byte after the final response, in
  the same read or later, makes the connection unusable: it is closed, never pooled, so
  no later request can take it for its answer (RFC 9112 section 6.3).
* **Errors come from a fixed vocabulary** (:class:`TransportFailure`): never the URL, an
  address or an OS message; a TLS failure names its cause (docs/protocol.md "Attempt
  records").
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
from collections.abc import Mapping
from typing import cast

import httptools

from supervisor.wire.tls import tls_failure

__all__ = ["ERROR_BODY_KEPT", "Http1Connection", "Response", "StaleConnection", "TransportFailure", "connect",
           "encode_request"]

Response = tuple[int, dict[str, str], bytes, bool]  # status, lower-cased headers, body, reusable
# What is kept of a non-2xx answer's body: enough for the attempt row's excerpt, no more. The
# rest is read (up to the cap, so the connection can be reused) but never held.
ERROR_BODY_KEPT = 256

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
# Always written by the connection itself; a caller's value would contradict the request.
_FRAMING = frozenset({"host", "content-length", "transfer-encoding", "connection"})


class TransportFailure(Exception):
    """An attempt's transport failure: ``kind`` is the attempt's error kind, ``error`` safe to store.

    The messages keep the names the attempt records have always used (``ConnectError``,
    ``ReadTimeout``...), so the history reads the same across releases.
    """

    def __init__(self, kind: str, error: str) -> None:
        super().__init__(error)
        self.kind = kind
        self.error = error


class StaleConnection(TransportFailure):
    """A reused connection failed before any byte of a response, right after the request
    was written: the peer had closed it.

    A server may close an idle keep-alive connection at any moment, so a request written
    as it closes fails without an answer (RFC 9112 section 9.3.1), within about a round trip.
    Sending the same bytes once more, on a new connection, is what common clients do and is
    safe here: receivers dedupe by ``idempotency_key`` (docs/protocol.md "Idempotency"). A
    failure later than :data:`STALE_WINDOW_SECONDS` after the write is no idle close (the
    receiver held the request): it is the attempt's, recorded and retried after back-off.
    """


STALE_WINDOW_SECONDS = 1.0


_CR_LF = (13, 10)


def _blank_run(data: bytes) -> int:
    """How many CR and LF bytes end ``data`` (a short tail is looked at first: no copy of a large read)."""
    tail = data[-16:]
    run = len(tail) - len(tail.rstrip(b"\r\n"))
    return len(data) - len(data.rstrip(b"\r\n")) if run == 16 else run


class _OutOfStep(Exception):
    """Raised from a parser callback to stop reading at a message after the answer."""


LOCAL_PROTOCOL_ERROR = TransportFailure("protocol_error",
                                        "LocalProtocolError: request could not be encoded as valid HTTP")
NOT_HTTP = TransportFailure("protocol_error", "RemoteProtocolError: response is not valid HTTP/1.1")
CLOSED_EARLY = TransportFailure("connection_error",
                                "RemoteProtocolError: connection closed before the response was complete")
READ_TIMEOUT = TransportFailure("timeout", "ReadTimeout: no response data within the read timeout")
CONNECT_TIMEOUT = TransportFailure("timeout", "ConnectTimeout: connect timed out")
HANDSHAKE_TIMEOUT = TransportFailure("timeout", "ConnectTimeout: TLS handshake timed out (connected)")
TOO_LARGE = TransportFailure("protocol_error", "RemoteProtocolError: response head or framing too large")
# What a response may cost in memory besides its capped body. The parser buffers a header
# until it ends, so the bytes before the final response's body are counted as they arrive
# (h11, under httpx, allows 16 KiB); and a body framed wastefully (tiny chunks, endless
# trailers) may not make the whole exchange exceed a bound either.
MAX_HEAD_BYTES = 64 * 1024
MAX_EXCHANGE_BYTES = 1024 * 1024


def _hint(exc: BaseException | None, fallback: str) -> str:
    """What an OS or TLS exception says, in the fixed vocabulary (never its own text)."""
    if isinstance(exc, ssl.SSLError):
        return tls_failure(exc)
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ConnectionResetError):
        return "connection reset by peer"
    if isinstance(exc, (BrokenPipeError, ConnectionAbortedError)):
        return "connection closed by peer"
    return fallback


def encode_request(target: str, host: str, headers: Mapping[str, str], body: bytes,
                   defaults: Mapping[str, str]) -> bytes:
    """The request head and body, byte for byte, or :data:`LOCAL_PROTOCOL_ERROR`.

    ``target`` and ``host`` are the canonical URL's own request target and authority, so
    what a receiver rebuilds as ``@target-uri`` is the URL that was signed. A header name
    that is not a token, or a value with CR, LF or another control character, is refused
    before anything is sent (a header cannot smuggle another one in).
    """
    fields = {name.lower(): (name, value) for name, value in defaults.items()}
    for name, value in headers.items():
        lowered = name.lower()
        if lowered not in _FRAMING:
            fields[lowered] = (name, value)
    lines = [f"POST {target} HTTP/1.1", f"Host: {host}"]
    for name, value in fields.values():
        if not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            raise LOCAL_PROTOCOL_ERROR
        lines.append(f"{name}: {value}")
    lines.append(f"Content-Length: {len(body)}\r\n\r\n")
    try:
        return "\r\n".join(lines).encode("latin-1") + body
    except UnicodeEncodeError:
        raise LOCAL_PROTOCOL_ERROR from None


class Http1Connection(asyncio.Protocol):
    """One keep-alive connection: one request at a time, the response parsed by llhttp.

    :meth:`request` writes the whole request and waits for the final response (``1xx``
    answers are skipped). The read timeout is the longest silence allowed while waiting
    (as httpx's read timeout); the caller bounds the whole attempt.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, body_cap: int) -> None:
        self._loop = loop
        self._body_cap = body_cap
        self._kept = body_cap  # how much of this answer's body is held (ERROR_BODY_KEPT unless 2xx)
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[Response] | None = None
        self._status = 0
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._final = False  # the headers of the final (non-1xx) response are in
        self._complete = False  # the final response has ended: any byte after it is out of step
        self._excess = False  # a byte after the final response arrived in the same read
        self._keep_alive = False  # the final response allows another request on this connection
        self._blank = 0  # how many CR and LF bytes end what this exchange has read
        self._framed = False  # its body has a length (or chunks): EOF mid-body is an error
        self._read_timeout = 0.0
        self._last_data = 0.0
        self._received = 0  # bytes of the current exchange
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.idle_since = 0.0
        self.answered = 0  # responses read whole on this connection: a reused one has answered before

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():  # bytes after the answer, before the next request: out of step
            self.abort()
            return
        self._last_data = self._loop.time()
        self._received += len(data)
        if data[-1] in _CR_LF:  # the stream's trailing run of CR and LF, for _blank_lines_after
            run = _blank_run(data)
            self._blank = self._blank + run if run == len(data) else run
        else:
            self._blank = 0
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):  # a 101 is no webhook answer either
            if not self._complete:
                self._fail(NOT_HTTP)
                return
            self._excess = True  # not even HTTP, after the answer
        if self._complete:  # decided once the whole read is parsed: bytes after the answer drop the connection
            self._finish(reusable=self._keep_alive and not (self._excess or self._blank_lines_after()))
        elif self._received > MAX_EXCHANGE_BYTES or (not self._final and self._received > MAX_HEAD_BYTES):
            self._fail(TOO_LARGE)

    def _blank_lines_after(self) -> bool:
        """Whether CR or LF bytes follow the answer that just ended.

        The parser skips them between messages without a callback (RFC 9112 section 2.2),
        so they are counted: the stream's trailing run of CR and LF is longer than the
        answer's own, which its framing fixes (a head or a chunked body ends in exactly two
        CRLF; a body of known length ends in its own bytes).
        """
        if self._blank == 0:
            return False
        if "transfer-encoding" in self._headers:
            return self._blank > 4
        body = b"".join(self._body)
        own = _blank_run(body)
        return self._blank > (own + 4 if own == len(body) else own)

    def eof_received(self) -> bool:
        return False  # a half-closed connection is of no use: close it (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is None or self._waiter.done():
            return
        if self._final and not self._framed:  # a body delimited by the close, however it closed
            self._finish(reusable=False)
        elif exc is None:
            self._fail(CLOSED_EARLY)
        else:
            self._fail(TransportFailure("connection_error",
                                        f"ReadError: {_hint(exc, 'connection failed while reading the response')}"))

    # ------------------------------------------------------------------ llhttp callbacks

    def on_message_begin(self) -> None:
        if self._complete:  # another message after the answer, in the same read (RFC 9112 section 6.3)
            self._excess = True
            raise _OutOfStep
        self._headers = {}
        self._final = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._final:  # a chunked body's trailer: not a response header
            return
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        known = self._headers.get(key)
        self._headers[key] = text if known is None else f"{known}, {text}"

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # informational (100 Continue, 103 Early Hints): the answer follows
            return
        self._status = status
        self._kept = self._body_cap if 200 <= status <= 299 else min(ERROR_BODY_KEPT, self._body_cap)
        self._final = True
        # RFC 9112 section 6.3: a transfer coding ending in chunked frames the body; any other
        # transfer coding (identity, gzip) is read until the close, whatever Content-Length says.
        coding = self._headers.get("transfer-encoding")
        self._framed = ("content-length" in self._headers if coding is None
                        else coding.rsplit(",", 1)[-1].strip().lower() == "chunked")

    def on_body(self, body: bytes) -> None:
        if not self._final or self._waiter is None:
            return
        if self._size < self._kept:
            self._body.append(body[:self._kept - self._size])
        self._size += len(body)
        if self._size >= self._body_cap:  # the cap: never read the rest
            self._finish(reusable=False)

    def on_message_complete(self) -> None:
        if self._final:
            self._complete = True
            self._keep_alive = self._parser.should_keep_alive()

    # ------------------------------------------------------------------ the request

    async def request(self, data: bytes, read_timeout: float) -> Response:
        """Send ``data`` (a whole request) and return the response; raises :class:`TransportFailure`.

        If the caller is cancelled (its deadline), the connection is left mid-exchange:
        the caller must not reuse it (``reusable`` is only ever true in a returned response).
        """
        reused = self.answered > 0
        if self.closed or self._transport is None or self._transport.is_closing():
            raise StaleConnection(CLOSED_EARLY.kind, CLOSED_EARLY.error) if reused else CLOSED_EARLY
        waiter: asyncio.Future[Response] = self._loop.create_future()
        self._waiter = waiter
        self._body, self._size, self._final, self._status, self._received = [], 0, False, 0, 0
        self._complete = self._excess = False
        self._blank = 0
        self._read_timeout = read_timeout
        self._last_data = self._loop.time()
        self._timer = self._loop.call_later(read_timeout, self._check_silence)
        self._transport.write(data)
        written = self._loop.time()
        try:
            return await waiter
        except TransportFailure as failure:
            if reused and self._received == 0 and failure.kind == "connection_error" \
                    and self._loop.time() - written < STALE_WINDOW_SECONDS:
                raise StaleConnection(failure.kind, failure.error) from None
            raise
        finally:
            self._waiter = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _check_silence(self) -> None:
        silent = self._loop.time() - self._last_data
        if silent >= self._read_timeout * 0.999:
            self._timer = None
            self._fail(READ_TIMEOUT)
        else:
            self._timer = self._loop.call_later(self._read_timeout - silent, self._check_silence)

    def _finish(self, *, reusable: bool) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        waiter.set_result((self._status, self._headers, b"".join(self._body), reusable and not self.closed))
        self.answered += 1
        if not reusable:
            self.abort()

    def _fail(self, failure: TransportFailure) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(failure)
        self.abort()

    # ------------------------------------------------------------------ closing

    def abort(self) -> None:
        """Drop the connection without a goodbye (mid-response, or out of step)."""
        self.closed = True
        if self._transport is not None:
            self._transport.abort()

    def close(self) -> None:
        """Close an idle connection politely (TLS close_notify)."""
        self.closed = True
        if self._transport is not None:
            self._transport.close()


async def connect(address: str, port: int, *, ssl_context: ssl.SSLContext | None, server_hostname: str,
                  timeout: float, body_cap: int) -> Http1Connection:
    """A TCP (and TLS) connection to exactly ``address``, a vetted IP, never a name lookup.

    TLS uses ``server_hostname`` (the URL's host) for SNI and the certificate check.
    Raises :class:`TransportFailure` (``ConnectTimeout``, ``ConnectError: <hint>``).
    """
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    handshaking = False
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, (address, port))
            handshaking = ssl_context is not None
            _, connection = await loop.create_connection(
                lambda: Http1Connection(loop, body_cap), sock=sock, ssl=ssl_context,
                server_hostname=server_hostname if ssl_context is not None else None,
                ssl_handshake_timeout=timeout if ssl_context is not None else None)
        return connection
    except TimeoutError:
        sock.close()
        raise (HANDSHAKE_TIMEOUT if handshaking else CONNECT_TIMEOUT) from None
    except (OSError, ssl.SSLError) as exc:  # SSLError is an OSError; named for the reader
        sock.close()
        if not handshaking:
            hint = _hint(exc, "could not connect")
        elif isinstance(exc, ssl.SSLError):
            hint = tls_failure(exc, "TLS handshake failed")
        else:  # the peer dropped the handshake
            hint = f"TLS handshake failed ({_hint(exc, 'connection lost')})"
        raise TransportFailure("connection_error", f"ConnectError: {hint}") from None
    except BaseException:
        sock.close()
        raise
