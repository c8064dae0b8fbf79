"""The daemon's HTTP sender: one POST per attempt, SSRF-safe, bounded in time and memory.

Why this is not just ``httpx.AsyncClient().post(url)``:

* **SSRF at send time** (docs/protocol.md "Destinations (SSRF)"). A buyer's host name is resolved and
  *every* address is vetted with :func:`outbox.urls.blocked_reason` right before sending,
  and the TCP connection goes to the vetted address only: a custom httpcore network
  backend (:class:`_PinnedBackend`) maps the URL's host name to the pinned IP in
  ``connect_tcp``. httpcore still passes the URL's host name as TLS ``server_hostname``
  (SNI and certificate check) and httpx still sends it as ``Host``, so the receiver sees a
  normal request while a DNS answer that changes between check and connect (rebinding)
  cannot redirect us into the private network.
* **Cheap pinning.** The ``adcp`` SDK builds a new IP-pinned transport per request (~50 ms
  CPU each). We pin per origin in a cache with a bounded TTL and keep one pooled client
  per origin, so steady-state sends reuse keep-alive connections and skip DNS entirely.
* **One client per origin** (``scheme://host:port``). A single AsyncClient shared by many
  concurrent requests degrades badly; per-origin clients with ``endpoint_concurrency``
  connections each also give natural per-endpoint isolation. The map is LRU-bounded.
* **Hostile receivers cannot hold us.** Redirects are never followed (docs/protocol.md "Destinations (SSRF)"), at
  most :data:`RESPONSE_BODY_CAP` bytes of a body are read (docs/protocol.md "Sizes and timeouts"), and the whole attempt
  (DNS + connect + exchange) has a hard deadline of ``connect + read`` timeout, which
  ``Settings`` guarantees is shorter than the lease, so a trickling receiver cannot make
  an attempt outlive its lease and be sent twice at once.
* **Errors are safe to store.** :attr:`HttpResult.error` is built from a fixed vocabulary:
  never the URL, its query string, a resolved address or resolver/OS exception text
  (docs/protocol.md, "Destinations (SSRF)", "Attempt records").
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from urllib.parse import urlsplit

import httpcore
import httpx

from outbox.config import Settings
from outbox.errors import OutboxValidationError
from outbox.urls import blocked_reason, canonicalize_url, origin
from supervisor.tls import tls_context

__all__ = ["RESPONSE_BODY_CAP", "HttpResult", "HttpSender", "Resolver"]

RESPONSE_BODY_CAP = 64 * 1024  # docs/protocol.md "Sizes and timeouts": the SDK captures at most 64 KiB of a response
SHARD_CONNECTIONS = 1  # connections per client of one origin (see _Origin)
KEEPALIVE_EXPIRY_SECONDS = 5.0  # below common server idle timeouts: avoids stale-socket races

Resolver = Callable[[str, int], Awaitable[list[str]]]

_EMPTY_HEADERS: Mapping[str, str] = MappingProxyType({})
# Default headers: identity encoding so the capped body is the receiver's raw bytes and a
# compression bomb cannot expand in memory; a product User-Agent instead of python-httpx.
_DEFAULT_HEADERS = {"User-Agent": "outboxd", "Accept-Encoding": "identity"}


@dataclass(frozen=True)
class HttpResult:
    """The outcome of one POST.

    Exactly one of ``status`` and ``error_kind`` is set: a response whose body broke off
    mid-way is reported as ``connection_error`` with ``status=None``, so a classifier never
    mistakes a truncated exchange for a delivered one (the retry is safe: receivers dedup
    by ``idempotency_key``, docs/protocol.md "Idempotency").
    """

    status: int | None  # None when no (complete) HTTP response
    headers: Mapping[str, str]  # lower-cased names
    body: bytes  # at most RESPONSE_BODY_CAP bytes read, the rest never read
    elapsed_ms: int
    error_kind: str | None  # None | "timeout" | "connection_error" | "protocol_error" | "blocked" | "invalid"
    error: str | None  # short, fixed vocabulary, <= 200 chars; no URL, query, IP or OS text

    @property
    def sent(self) -> bool:
        """Whether a request may have reached the destination (counts for its breaker)."""
        return self.error_kind not in ("blocked", "invalid")


class _Refused(Exception):
    """Internal: the attempt ends before any connection; carries the result fields."""

    def __init__(self, kind: str, error: str) -> None:
        super().__init__(error)
        self.kind = kind
        self.error = error


async def _default_resolver(host: str, port: int) -> list[str]:
    """All addresses ``host`` resolves to, via the event loop's (threaded) getaddrinfo."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _bare_host(host: str) -> str:
    return host.strip("[]").lower()


class _PinnedBackend(httpcore.AsyncNetworkBackend):
    """An httpcore network backend that connects one host name to its vetted addresses only.

    httpcore asks ``connect_tcp(host=<URL host>, port)``; we ignore DNS and connect to the
    addresses :class:`HttpSender` vetted, trying them in order on a refused/unreachable
    connect (a timeout is not retried: the deadline would multiply). TLS happens afterwards
    in httpcore with ``server_hostname`` = the URL host, so SNI and certificate checks are
    unaffected. A host we have no vetted address for fails closed.
    """

    def __init__(self, host: str) -> None:
        self._host = _bare_host(host)
        self._inner = httpcore.AnyIOBackend()
        self.addresses: tuple[str, ...] = ()  # replaced only with freshly vetted tuples
        self.expires_at = 0.0  # monotonic time after which the pin must be re-vetted

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        addresses = self.addresses
        if _bare_host(host) != self._host or not addresses:
            raise httpcore.ConnectError("no vetted address for this host")
        last: httpcore.ConnectError | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address, port, timeout=timeout, local_address=local_address, socket_options=socket_options
                )
            except httpcore.ConnectError as exc:
                last = exc
        assert last is not None
        raise last

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are not webhook destinations")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


@dataclass(eq=False)
class _Origin:
    """One destination origin: its pooled clients, its pin, and who is using it.

    httpcore's pool scans every connection on each request, so its CPU cost per request
    grows with the pool. A busy origin is therefore served by several small clients
    (shards) sharing one pin, each request going to the least busy shard: the same
    connection budget at a fraction of the cost. Measured here, 4,000 POSTs at concurrency
    32 to one local origin: one 32-connection client 2.38 ms CPU per request (371/s);
    8-connection shards 0.69 ms; 2-connection 0.58 ms; 1-connection 0.53 ms (1,870/s).
    """

    clients: list[httpx.AsyncClient]
    backend: _PinnedBackend
    busy: list[int] = field(default_factory=list)  # requests in flight per shard
    inflight: int = 0
    evicted: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # serialises re-resolution

    def take(self) -> int:
        shard = min(range(len(self.clients)), key=self.busy.__getitem__)
        self.busy[shard] += 1
        return shard

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()


def _ssl_context(settings: Settings, verify: ssl.SSLContext | str | bool | None) -> ssl.SSLContext:
    """Build the TLS context once: creating one per client costs milliseconds of CPU.

    ``None`` (the daemon): the operator's trust settings (:func:`supervisor.tls.tls_context`).
    """
    if verify is None:
        return tls_context(settings)
    if isinstance(verify, ssl.SSLContext):
        return verify
    if isinstance(verify, str):
        if os.path.isdir(verify):
            return ssl.create_default_context(capath=verify)
        return ssl.create_default_context(cafile=verify)
    return httpx.create_ssl_context(verify=verify, trust_env=False)


class HttpSender:
    """POSTs webhook bodies; owns the per-origin clients and the DNS pins.

    Not thread-safe; use from one event loop. ``resolver`` exists for tests and custom DNS
    (it must return address strings); ``verify`` overrides the configured trust (tests).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        resolver: Resolver | None = None,
        dns_ttl_seconds: float = 60.0,
        max_origins: int = 1024,
        verify: ssl.SSLContext | str | bool | None = None,
    ) -> None:
        if max_origins < 1:
            raise ValueError("max_origins must be at least 1")
        self._settings = settings
        self._resolve = resolver or _default_resolver
        self._ttl = max(0.0, dns_ttl_seconds)
        self._max_origins = max_origins
        self._ssl = _ssl_context(settings, verify)
        self._origins: OrderedDict[str, _Origin] = OrderedDict()
        self._closed = False
        self._timeout = httpx.Timeout(
            connect=settings.connect_timeout_seconds,
            read=settings.read_timeout_seconds,
            write=settings.read_timeout_seconds,
            pool=settings.connect_timeout_seconds,
        )
        # The lease invariant in Settings is "lease > connect + read": hold every attempt to it.
        self._deadline = settings.connect_timeout_seconds + settings.read_timeout_seconds

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> HttpResult:
        """POST ``body`` to ``url`` (sent in its canonical form, the one that was signed).

        Never raises for anything the destination does; the result says what happened.
        """
        if self._closed:
            raise RuntimeError("HttpSender is closed")
        started = time.monotonic()
        entry: _Origin | None = None
        try:
            async with asyncio.timeout(self._deadline):
                target, key, host, port = self._parse(url)
                entry = await self._acquire(key, host, port)
                shard = entry.take()
                try:
                    request = _signed_request(entry.clients[shard], url, target, body, headers)
                    status, resp_headers, resp_body = await self._exchange(entry.clients[shard], request)
                finally:
                    entry.busy[shard] -= 1
            return HttpResult(status, resp_headers, resp_body, _ms(started), None, None)
        except _Refused as exc:
            return HttpResult(None, _EMPTY_HEADERS, b"", _ms(started), exc.kind, exc.error)
        except httpx.InvalidURL:  # canonical, yet httpx refuses it: as unusable as a bad URL
            return HttpResult(None, _EMPTY_HEADERS, b"", _ms(started), "blocked", "destination URL is not valid")
        except (TimeoutError, httpx.HTTPError, OSError) as exc:
            kind, error = _describe(exc)
            return HttpResult(None, _EMPTY_HEADERS, b"", _ms(started), kind, error)
        finally:
            if entry is not None:
                entry.inflight -= 1
                if entry.evicted and entry.inflight == 0:
                    await entry.aclose()

    async def aclose(self) -> None:
        """Close every pooled connection. Further ``post`` calls raise ``RuntimeError``."""
        self._closed = True
        entries = list(self._origins.values())
        self._origins.clear()
        for entry in entries:
            await entry.aclose()

    # ------------------------------------------------------------------ internals

    def _parse(self, url: str) -> tuple[str, str, str, int]:
        """Canonical URL, origin key, host and port; refuses disallowed schemes."""
        try:
            target = canonicalize_url(url)
            parts = urlsplit(target)
            port = parts.port
        except (OutboxValidationError, ValueError):
            raise _Refused("blocked", "destination URL is not valid") from None
        scheme = parts.scheme
        if scheme != "https" and not (scheme == "http" and self._settings.allow_http):
            raise _Refused("blocked", "destination scheme is not allowed (https required)")
        host = parts.hostname or ""
        if not host:
            raise _Refused("blocked", "destination URL is not valid")
        return target, origin(target), host, port or (443 if scheme == "https" else 80)

    async def _acquire(self, key: str, host: str, port: int) -> _Origin:
        """The origin's client, counted as in use, with a pin younger than the TTL.

        The in-use count is taken before any await, so LRU eviction never closes a client
        a request is about to use. The caller releases it (``post``'s ``finally``), also
        when vetting raises.
        """
        entry = self._origins.get(key)
        if entry is None:
            addresses = await self._resolve_and_vet(host, port)  # blocked origins get no client
            entry = self._origins.get(key)  # another task may have created it meanwhile
            if entry is None:
                entry = self._new_origin(key, host)
            entry.backend.addresses = addresses
            entry.backend.expires_at = time.monotonic() + self._ttl
            entry.inflight += 1
            return entry
        self._origins.move_to_end(key)
        entry.inflight += 1
        if entry.backend.expires_at <= time.monotonic():
            try:
                async with entry.lock:  # one re-resolution per origin at a time
                    if entry.backend.expires_at <= time.monotonic():
                        entry.backend.addresses = await self._resolve_and_vet(host, port)
                        entry.backend.expires_at = time.monotonic() + self._ttl
            except BaseException:
                entry.inflight -= 1
                raise
        return entry

    async def _resolve_and_vet(self, host: str, port: int) -> tuple[str, ...]:
        """docs/protocol.md "Destinations (SSRF)": every address must pass; one blocked address blocks the host."""
        try:
            literal = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        if literal is not None:
            answers: list[str] = [str(literal)]
        else:
            try:
                async with asyncio.timeout(self._settings.connect_timeout_seconds):
                    answers = await self._resolve(host, port)
            except TimeoutError:
                raise _Refused("timeout", "NameResolutionTimeout: host name did not resolve in time") from None
            except (OSError, UnicodeError, ValueError):
                raise _Refused("connection_error", "NameResolutionError: host name could not be resolved") from None
        vetted: list[str] = []
        for answer in answers:
            try:
                address = ipaddress.ip_address(answer)
            except ValueError:
                raise _Refused("blocked", "destination address is not allowed (unparseable)") from None
            reason = blocked_reason(address, self._settings.allowed_cidrs)
            if reason is not None:
                raise _Refused("blocked", f"destination address is not allowed ({reason})"[:200])
            vetted.append(str(address))
        if not vetted:
            raise _Refused("connection_error", "NameResolutionError: host name has no addresses")
        return tuple(vetted)

    def _new_origin(self, key: str, host: str) -> _Origin:
        backend = _PinnedBackend(host)
        budget = self._settings.endpoint_concurrency
        shards = -(-budget // SHARD_CONNECTIONS)
        entry = _Origin(clients=[self._new_client(backend, -(-budget // shards)) for _ in range(shards)],
                        backend=backend, busy=[0] * shards)
        self._origins[key] = entry
        while len(self._origins) > self._max_origins:
            _, old = self._origins.popitem(last=False)
            old.evicted = True
            if old.inflight == 0:
                # Not awaited here: closing idle pooled sockets needs no I/O wait worth
                # blocking this send on; the task holds a reference until done.
                _spawn(old.aclose())
        return entry

    def _new_client(self, backend: _PinnedBackend, connections: int) -> httpx.AsyncClient:
        limits = httpx.Limits(
            max_connections=connections,
            max_keepalive_connections=connections,
            keepalive_expiry=KEEPALIVE_EXPIRY_SECONDS,
        )
        transport = httpx.AsyncHTTPTransport(verify=self._ssl, trust_env=False, limits=limits, retries=0)
        # httpx has no public hook for the network backend: swap in an identical pool that
        # uses ours. tests/test_transport.py (DNS rebinding, SNI) fails if this stops working.
        transport._pool = httpcore.AsyncConnectionPool(
            ssl_context=self._ssl,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            http1=True,
            http2=False,
            retries=0,
            network_backend=backend,
        )
        return httpx.AsyncClient(
            transport=transport,
            timeout=self._timeout,
            follow_redirects=False,
            trust_env=False,
            headers=_DEFAULT_HEADERS,
        )

    async def _exchange(self, client: httpx.AsyncClient, request: httpx.Request) -> tuple[int, Mapping[str, str], bytes]:
        """Send, read the status, headers and at most RESPONSE_BODY_CAP body bytes."""
        response = await client.send(request, stream=True)
        try:
            chunks: list[bytes] = []
            size = 0
            # Raw (undecoded) bytes: we asked for identity; a receiver that compresses
            # anyway gets its bytes stored as sent, never inflated.
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
                size += len(chunk)
                if size >= RESPONSE_BODY_CAP:
                    break  # leaving the block closes the response; the socket is discarded
            resp_headers = {k.lower(): v for k, v in response.headers.items()}
            return response.status_code, MappingProxyType(resp_headers), b"".join(chunks)[:RESPONSE_BODY_CAP]
        finally:
            await response.aclose()


def _wire_url(request: httpx.Request) -> str:
    """The URL a receiver rebuilds from this request: scheme, ``Host`` and request target.

    httpx writes ``request.url.raw_path`` as the HTTP/1.1 request target, and the AdCP
    verifier reconstructs ``@target-uri`` from it and the ``Host`` header.
    """
    return f"{request.url.scheme}://{request.headers['host']}{request.url.raw_path.decode('ascii')}"


def _signed_request(
    client: httpx.AsyncClient, signed_url: str, target: str, body: bytes, headers: Mapping[str, str]
) -> httpx.Request:
    """The request httpx will put on the wire, refused unless it carries the signed URL.

    httpx escapes some characters itself and removes dot segments; a URL it would alter
    could never verify, so it ends ``dead invalid`` here instead of as a signature the buyer
    rejects. ``outbox.urls.canonicalize_url`` (applied at enqueue and again to every claimed
    row) yields a form httpx leaves alone, so this fires only for a caller that signed a
    non-canonical URL, or an httpx whose encoding changed.
    """
    request = client.build_request("POST", target, content=body, headers=headers)
    if _wire_url(request) != signed_url:
        raise _Refused("invalid", "request target would differ from the signed @target-uri (URL not canonical)")
    return request


_background: set[asyncio.Task[None]] = set()


def _spawn(coro: Awaitable[None]) -> None:
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


def _ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)


# Messages h11/httpcore use when the peer hung up early, as opposed to sending bytes that
# are not HTTP. Both surface as httpx.RemoteProtocolError; only the text tells them apart.
_PEER_CLOSED_MARKERS = ("server disconnected", "peer closed connection")


def _describe(exc: BaseException) -> tuple[str, str]:
    """Map an exception to (error_kind, safe message). Never uses the exception's text
    except to tell "peer hung up" from "peer spoke garbage" (not copied into the result).

    * timeouts (httpx's, and our whole-attempt deadline) -> ``timeout``;
    * ``RemoteProtocolError`` saying the server disconnected before or during the
      response -> ``connection_error``; any other ``RemoteProtocolError`` (h11 could not
      parse the bytes: bad status line, bad header, bad chunking) and
      ``LocalProtocolError`` -> ``protocol_error``;
    * ``ConnectError`` / ``ReadError`` / ``WriteError`` / other ``HTTPError`` / ``OSError``
      -> ``connection_error``, with a hint (refused, reset, TLS) taken from the cause chain.
    """
    name = type(exc).__name__
    if isinstance(exc, (httpx.TimeoutException, TimeoutError)):
        messages = {
            "ConnectTimeout": "connect timed out",
            "ReadTimeout": "no response data within the read timeout",
            "WriteTimeout": "request body not accepted within the write timeout",
            "PoolTimeout": "no pooled connection free within the connect timeout",
        }
        if not isinstance(exc, httpx.TimeoutException):
            name = "DeadlineExceeded"
        return "timeout", f"{name}: {messages.get(name, 'attempt exceeded connect + read timeout')}"
    if isinstance(exc, httpx.RemoteProtocolError):
        if any(marker in str(exc).lower() for marker in _PEER_CLOSED_MARKERS):
            return "connection_error", f"{name}: connection closed before the response was complete"
        return "protocol_error", f"{name}: response is not valid HTTP/1.1"
    if isinstance(exc, httpx.LocalProtocolError):
        return "protocol_error", f"{name}: request could not be encoded as valid HTTP"
    return "connection_error", f"{name}: {_cause_hint(exc)}"


def _cause_hint(exc: BaseException) -> str:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLCertVerificationError):
            return "TLS certificate verification failed"
        if isinstance(current, ssl.SSLError):
            return "TLS handshake failed"
        if isinstance(current, ConnectionRefusedError):
            return "connection refused"
        if isinstance(current, ConnectionResetError):
            return "connection reset by peer"
        if isinstance(current, (BrokenPipeError, ConnectionAbortedError)):
            return "connection closed by peer"
        current = current.__cause__ or current.__context__
    if isinstance(exc, httpx.ConnectError):
        return "could not connect"
    if isinstance(exc, httpx.ReadError):
        return "connection failed while reading the response"
    if isinstance(exc, httpx.WriteError):
        return "connection failed while sending the request"
    return "transport failure"
