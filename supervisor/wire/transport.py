"""The daemon's HTTP sender: one POST per attempt, SSRF-safe, bounded in time and memory.

Why this is not just ``httpx.AsyncClient().post(url)``:

* **SSRF at send time** (docs/protocol.md "Destinations (SSRF)"). A buyer's host name is
  resolved and *every* address is vetted with :func:`outbox.urls.blocked_reason` right
  before sending, and the TCP connection goes to a vetted address only
  (:func:`supervisor.wire.http1.connect` takes an IP, never a name). TLS still uses the URL's
  host name as ``server_hostname`` (SNI and certificate check) and ``Host`` carries it, so
  the receiver sees a normal request while a DNS answer that changes between check and
  connect (rebinding) cannot redirect us into the private network.
* **Cheap pinning.** The ``adcp`` SDK builds a new IP-pinned transport per request (~50 ms
  CPU each). We pin per origin in a cache with a bounded TTL and keep a pool of keep-alive
  connections per origin, so steady-state sends skip DNS and handshakes entirely.
* **One pool per origin** (``scheme://host:port``) of at most ``endpoint_concurrency``
  connections, the most recently used reused first; the map of origins is LRU-bounded.
* **The exact bytes, cheaply.** The request is written from the signed canonical URL by
  :mod:`supervisor.wire.http1`, at a small fraction of a general client's CPU per request
  (docs/performance.md, "The HTTP client").
* **Hostile receivers cannot hold us.** Redirects are never followed (docs/protocol.md
  "Destinations (SSRF)"), at most :data:`RESPONSE_BODY_CAP` bytes of a body are read
  (docs/protocol.md "Sizes and timeouts") and at most 256 of a failed answer's are held, and
  the whole attempt (DNS + connect + exchange) has a hard deadline of ``connect + read``
  timeout, which ``Settings`` guarantees is shorter than the lease, so a trickling receiver
  cannot make an attempt outlive its lease and be sent twice at once.
* **An idle connection the receiver closed is not its failure:** a request failing on a
  reused connection before any answer byte is sent once more, at once, on a new one
  (:class:`supervisor.wire.http1.StaleConnection`); any other failure is the attempt's.
* **Errors are safe to store.** :attr:`HttpResult.error` is built from a fixed vocabulary:
  never the URL, its query string, a resolved address or resolver/OS exception text
  (docs/protocol.md, "Destinations (SSRF)", "Attempt records").
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import ssl
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from urllib.parse import urlsplit

from outbox.config import Settings
from outbox.errors import OutboxValidationError
from outbox.urls import blocked_reason, canonicalize_url, origin
from supervisor.wire.http1 import Http1Connection, StaleConnection, TransportFailure, connect, encode_request
from supervisor.wire.tls import sender_context

__all__ = ["RESPONSE_BODY_CAP", "HttpResult", "HttpSender", "Resolver"]

RESPONSE_BODY_CAP = 64 * 1024  # docs/protocol.md "Sizes and timeouts": the SDK captures at most 64 KiB of a response
KEEPALIVE_EXPIRY_SECONDS = 5.0  # below common server idle timeouts: avoids stale-socket races

Resolver = Callable[[str, int], Awaitable[list[str]]]

_EMPTY_HEADERS: Mapping[str, str] = MappingProxyType({})
# Identity encoding so the capped body is the receiver's raw bytes and a compression bomb
# cannot expand in memory; a product User-Agent.
_DEFAULT_HEADERS = MappingProxyType({"User-Agent": "outboxd", "Accept-Encoding": "identity"})
DEADLINE_EXCEEDED = TransportFailure("timeout", "DeadlineExceeded: attempt exceeded connect + read timeout")
POOL_TIMEOUT = TransportFailure("timeout", "PoolTimeout: no pooled connection free within the connect timeout")


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
    # At most RESPONSE_BODY_CAP bytes read, the rest never read; of a non-2xx answer only the
    # first ERROR_BODY_KEPT bytes are held (the attempt row's excerpt).
    body: bytes
    elapsed_ms: int
    error_kind: str | None  # None | "timeout" | "connection_error" | "protocol_error" | "blocked" | "invalid"
    error: str | None  # short, fixed vocabulary, <= 200 chars; no URL, query, IP or OS text

    @property
    def sent(self) -> bool:
        """Whether a request may have reached the destination (counts for its breaker)."""
        return self.error_kind not in ("blocked", "invalid")


class _Refused(TransportFailure):
    """The attempt ends before any connection (a blocked or unusable destination)."""


async def _default_resolver(host: str, port: int) -> list[str]:
    """All addresses ``host`` resolves to, via the event loop's (threaded) getaddrinfo."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True)
class _Target:
    """A canonical URL split the way it goes on the wire."""

    origin: str  # the pool key, scheme://authority
    host: str  # the URL's host, bare (no brackets): TLS server_hostname, what DNS resolves
    port: int
    authority: str  # the Host header
    path: str  # the request target: path and query, as signed
    scheme: str
    canonical: bool  # the URL given is its canonical form (else it cannot be what was signed)


@dataclass(eq=False)
class _Origin:
    """One destination origin: its DNS pin and its pool of keep-alive connections.

    ``opened`` counts connections open or opening (idle ones included), never more than
    the origin's budget; a request that finds none free waits for one (``waiters``).
    """

    target: _Target
    addresses: tuple[str, ...] = ()  # replaced only with freshly vetted tuples
    expires_at: float = 0.0  # monotonic time after which the pin must be re-vetted
    idle: list[Http1Connection] = field(default_factory=list)  # most recently used last
    opened: int = 0
    waiters: deque[asyncio.Future[Http1Connection | None]] = field(default_factory=deque)
    inflight: int = 0  # requests using this entry (eviction closes it only when 0)
    evicted: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # serialises re-resolution

    def close_idle(self) -> None:
        for connection in self.idle:
            connection.close()
        self.opened -= len(self.idle)
        self.idle.clear()


@functools.lru_cache(maxsize=4096)  # pure: the same buyer URLs come back on every attempt
def _target(url: str) -> _Target:
    """``url``'s wire parts, from its canonical form; refuses a URL that has none, or no host."""
    try:
        canonical = canonicalize_url(url)
        parts = urlsplit(canonical)
        port = parts.port
    except (OutboxValidationError, ValueError):
        raise _Refused("blocked", "destination URL is not valid") from None
    scheme, host = parts.scheme, parts.hostname or ""
    if not host:
        raise _Refused("blocked", "destination URL is not valid")
    prefix = f"{scheme}://{parts.netloc}"
    return _Target(origin(canonical), host, port or (443 if scheme == "https" else 80), parts.netloc,
                   canonical[len(prefix):], scheme, canonical == url)


class HttpSender:
    """POSTs webhook bodies; owns the per-origin connection pools and the DNS pins.

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
        verify: ssl.SSLContext | str | None = None,
    ) -> None:
        if max_origins < 1:
            raise ValueError("max_origins must be at least 1")
        self._settings = settings
        self._resolve = resolver or _default_resolver
        self._ttl = max(0.0, dns_ttl_seconds)
        self._max_origins = max_origins
        self._ssl = sender_context(settings, verify)
        self._origins: OrderedDict[str, _Origin] = OrderedDict()
        self._closed = False
        # The lease invariant in Settings is "lease > connect + read": hold every attempt to it.
        self._deadline = settings.connect_timeout_seconds + settings.read_timeout_seconds

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> HttpResult:
        """POST ``body`` to ``url``, which must be canonical (it is what was signed).

        Never raises for anything the destination does; the result says what happened.
        """
        if self._closed:
            raise RuntimeError("HttpSender is closed")
        started = time.monotonic()
        entry: _Origin | None = None
        connection: Http1Connection | None = None
        reusable = False
        try:
            async with asyncio.timeout(self._deadline):
                target = _target(url)
                if target.scheme != "https" and not (target.scheme == "http" and self._settings.allow_http):
                    raise _Refused("blocked", "destination scheme is not allowed (https required)")
                data = encode_request(target.path, target.authority, headers, body, _DEFAULT_HEADERS)
                entry = await self._acquire(target)  # SSRF vetting first: a blocked address says so
                if not target.canonical:
                    # A caller that signed another spelling: a verifier would rebuild a different
                    # @target-uri, so the signature could never verify (docs/protocol.md "Signing").
                    raise _Refused("invalid", "request target would differ from the signed @target-uri "
                                              "(URL not canonical)")
                connection = await self._checkout(entry)
                try:
                    status, resp_headers, resp_body, reusable = await connection.request(
                        data, self._settings.read_timeout_seconds)
                except StaleConnection:  # closed by the peer while idle: once more, at once, on a new one
                    connection.abort()
                    connection = None  # its pool slot goes to the new connection
                    connection = await self._open(entry)
                    status, resp_headers, resp_body, reusable = await connection.request(
                        data, self._settings.read_timeout_seconds)
            return HttpResult(status, MappingProxyType(resp_headers), resp_body, _ms(started), None, None)
        except TransportFailure as exc:
            return HttpResult(None, _EMPTY_HEADERS, b"", _ms(started), exc.kind, exc.error)
        except TimeoutError:
            return HttpResult(None, _EMPTY_HEADERS, b"", _ms(started), DEADLINE_EXCEEDED.kind, DEADLINE_EXCEEDED.error)
        finally:
            if entry is not None:
                if connection is not None:
                    self._checkin(entry, connection, reusable)
                entry.inflight -= 1
                if entry.evicted and entry.inflight == 0:
                    entry.close_idle()

    async def aclose(self) -> None:
        """Close every pooled connection. Further ``post`` calls raise ``RuntimeError``."""
        self._closed = True
        entries = list(self._origins.values())
        self._origins.clear()
        for entry in entries:
            entry.evicted = True
            entry.close_idle()
        await asyncio.sleep(0)  # let the transports run their close callbacks

    # ------------------------------------------------------------------ the destination

    async def _acquire(self, target: _Target) -> _Origin:
        """The origin's entry, counted as in use, with a pin younger than the TTL.

        The in-use count is taken before any await, so LRU eviction never closes a pool a
        request is about to use. The caller releases it (``post``'s ``finally``), also
        when vetting raises.
        """
        key = target.origin
        entry = self._origins.get(key)
        if entry is None:
            addresses = await self._resolve_and_vet(target.host, target.port)  # blocked origins get no pool
            entry = self._origins.get(key)  # another task may have created it meanwhile
            if entry is None:
                entry = self._new_origin(target)
            entry.addresses = addresses
            entry.expires_at = time.monotonic() + self._ttl
            entry.inflight += 1
            return entry
        self._origins.move_to_end(key)
        entry.inflight += 1
        if entry.expires_at <= time.monotonic():
            try:
                async with entry.lock:  # one re-resolution per origin at a time
                    if entry.expires_at <= time.monotonic():
                        entry.addresses = await self._resolve_and_vet(target.host, target.port)
                        entry.expires_at = time.monotonic() + self._ttl
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

    def _new_origin(self, target: _Target) -> _Origin:
        entry = _Origin(target)
        self._origins[target.origin] = entry
        while len(self._origins) > self._max_origins:
            _, old = self._origins.popitem(last=False)
            old.evicted = True
            if old.inflight == 0:
                old.close_idle()
        return entry

    # ------------------------------------------------------------------ the pool

    async def _checkout(self, entry: _Origin) -> Http1Connection:
        """A connection of ``entry``'s: an idle one still fresh, a new one, or the next freed."""
        now = time.monotonic()
        while entry.idle:
            connection = entry.idle.pop()
            if not connection.closed and now - connection.idle_since < KEEPALIVE_EXPIRY_SECONDS:
                return connection
            connection.close()
            entry.opened -= 1
        if entry.opened < self._settings.endpoint_concurrency:
            entry.opened += 1
            return await self._open(entry)
        waiter: asyncio.Future[Http1Connection | None] = asyncio.get_running_loop().create_future()
        entry.waiters.append(waiter)
        try:
            async with asyncio.timeout(self._settings.connect_timeout_seconds):
                handed = await waiter
        except BaseException as exc:  # timed out or cancelled, possibly just as one was handed over
            if waiter in entry.waiters:
                entry.waiters.remove(waiter)
            elif waiter.done() and not waiter.cancelled():  # handed over: give it back, never leak it
                handed = waiter.result()
                if handed is None:
                    entry.opened -= 1
                    self._wake(entry)
                else:
                    self._checkin(entry, handed, True)
            if isinstance(exc, TimeoutError):
                raise POOL_TIMEOUT from None
            raise
        return handed if handed is not None else await self._open(entry)

    async def _open(self, entry: _Origin) -> Http1Connection:
        """Connect to the pinned addresses in order (a refused or unreachable one is skipped;
        a timeout is not retried: the deadline would multiply). Counted in ``opened`` already."""
        target = entry.target
        try:
            failure: TransportFailure | None = None
            for address in entry.addresses:
                try:
                    return await connect(address, target.port,
                                         ssl_context=self._ssl if target.scheme == "https" else None,
                                         server_hostname=target.host, timeout=self._settings.connect_timeout_seconds,
                                         body_cap=RESPONSE_BODY_CAP)
                except TransportFailure as exc:
                    if exc.kind == "timeout":
                        raise
                    failure = exc
            raise failure or TransportFailure("connection_error", "ConnectError: no vetted address for this host")
        except BaseException:
            entry.opened -= 1
            self._wake(entry)
            raise

    def _checkin(self, entry: _Origin, connection: Http1Connection, reusable: bool) -> None:
        """Return a connection after its request: to a waiter, to the idle pool, or closed."""
        if reusable and not connection.closed and not entry.evicted:
            while entry.waiters:
                waiter = entry.waiters.popleft()
                if not waiter.done():
                    waiter.set_result(connection)
                    return
            connection.idle_since = time.monotonic()
            entry.idle.append(connection)
            return
        connection.abort()
        entry.opened -= 1
        self._wake(entry)

    def _wake(self, entry: _Origin) -> None:
        """A connection slot freed: the first waiter opens a connection in it."""
        while entry.waiters:
            waiter = entry.waiters.popleft()
            if not waiter.done():
                entry.opened += 1
                waiter.set_result(None)
                return


def _ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)
