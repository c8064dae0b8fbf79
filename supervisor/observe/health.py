"""The ``/metrics``, ``/healthz`` and ``/readyz`` endpoint on ``OUTBOX_METRICS_ADDR``, which
also serves JSON documents such as the keyring's JWKS (``supervisor.keys.keyring_cache``).

A tiny asyncio HTTP/1.1 server, so it shares the daemon's event loop and needs no thread.
``/readyz`` checks the database and the migration revision at most every few seconds,
so an aggressive probe cannot load the database.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from outbox.config_values import parse_addr
from supervisor.observe.metrics import Metrics

READY_CACHE_SECONDS = 2.0
# How long ``/readyz`` waits for its check; the daemon's check cuts its own connection then,
# and the wait here, a second longer, is only the backstop.
READY_CHECK_SECONDS = 5.0


class HealthServer:
    def __init__(self, metrics: Metrics, ready_check: Callable[[], Awaitable[str | None]],
                 documents: Mapping[str, Callable[[], bytes | None]] | None = None,
                 notice: Callable[[], str | None] = lambda: None) -> None:
        self._metrics = metrics
        # What a ready daemon still wants the operator to know (a scope paused for want of a
        # key): said on /readyz's line, without failing it (restarting would not help, and
        # the daemon still serves every other scope and the JWKS).
        self._notice = notice
        self._documents = dict(documents or {})  # path -> JSON bytes now (None: not available)
        self._ready_check = ready_check
        self._ready: tuple[float, str | None] = (0.0, "not checked yet")
        self._server: asyncio.Server | None = None

    async def start(self, addr: str) -> tuple[str, int]:
        host, port = parse_addr(addr, "OUTBOX_METRICS_ADDR")
        self._server = await asyncio.start_server(self._handle, host, port)
        return self._server.sockets[0].getsockname()[:2]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _readiness(self) -> str | None:
        checked_at, problem = self._ready
        if time.monotonic() - checked_at > READY_CACHE_SECONDS:
            try:
                problem = await asyncio.wait_for(self._ready_check(), READY_CHECK_SECONDS + 1.0)
            except Exception as exc:
                problem = f"database check failed: {type(exc).__name__}"
            self._ready = (time.monotonic(), problem)
        return problem

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5.0)
            while (await asyncio.wait_for(reader.readline(), 5.0)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) >= 2 else ""
            if path == "/metrics":  # readiness as a gauge: a daemon that waits or fails is still "up"
                self._metrics.ready.set(0 if await self._readiness() else 1)
                status, ctype, body = 200, CONTENT_TYPE_LATEST, generate_latest(self._metrics.registry)
            elif path == "/healthz":
                status, ctype, body = 200, "text/plain", b"ok\n"
            elif path == "/readyz":
                problem = await self._readiness()
                status, ctype = (200, "text/plain") if problem is None else (503, "text/plain")
                notice = self._notice() if problem is None else None
                body = (problem or ("ready; " + notice if notice else "ready")).encode() + b"\n"
            elif (document := self._documents[path]() if path in self._documents else None) is not None:
                status, ctype, body = 200, "application/json", document
            else:
                status, ctype, body = 404, "text/plain", b"not found\n"
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
            writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         "Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
