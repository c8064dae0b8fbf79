"""The receiver's HTTP/1.1 server: it records every arrival and answers as the path says.

Paths (one process can play healthy, flaky, hostile and hanging buyers at once):

    /ok                   200
    /flaky/N[/CODE]       CODE (default 503) for the first N arrivals of each key, then 200
    /status/CODE          always CODE (401 carries a webhook_signature_invalid challenge)
    /hang                 accepts and never answers
    /delay/MS             200 after MS milliseconds
    /chaos/PCT[/MAX]      PCT % of requests fail at random: 500, slow, reset or hang
                          (at most MAX times per idempotency key, if given)
    /noecho               200, but never echoes a webhook.challenge (every other path does)

Loopback only: it binds 127.0.0.1, over plain HTTP or TLS (``ssl_context``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import socket
import ssl
import struct
import time
from collections import Counter
from typing import IO

from outboxd_receiver.verifiers import Verifier


class Receiver:
    """One process playing many buyers; ``scheme`` is what the signed ``@target-uri`` used."""

    def __init__(self, verifier: Verifier | None, log: IO[str] | None, *, seed: int = 0,
                 scheme: str = "http", log_bodies: bool = False) -> None:
        self._verify = verifier
        self._scheme = scheme
        self._log = log
        self._log_bodies = log_bodies
        self._seen: Counter[str] = Counter()
        self._chaos_given: Counter[str] = Counter()
        self._random = random.Random(seed)
        self.arrivals = 0
        self.failures = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                status, extra, answer = await self._respond(method, target, headers, body, writer)
                if status is None:
                    return
                reply = f"HTTP/1.1 {status} X\r\nContent-Length: {len(answer)}\r\n{extra}\r\n"
                writer.write(reply.encode() + answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _respond(self, method: str, target: str, headers: dict[str, str], body: bytes,
                       writer: asyncio.StreamWriter) -> tuple[int | None, str, bytes]:
        self.arrivals += 1
        url = f"{self._scheme}://{headers.get('host', '')}{target}"
        problem = self._verify(method, url, headers, body) if self._verify and "signature" in headers else None
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = {}
        parsed = parsed if isinstance(parsed, dict) else {}
        kind = parsed.get("type") or parsed.get("notification_type")
        # A challenge has no idempotency_key: /flaky counts its arrivals by its value.
        key = parsed.get("challenge" if kind == "webhook.challenge" else "idempotency_key", "")
        self._seen[key] += 1
        parts = target.split("?")[0].strip("/").split("/")
        status: int | None = 200
        extra, answer = "", b""
        if problem is not None:
            self.failures += 1
            status, extra = 401, f'WWW-Authenticate: Signature error="{problem.split()[0]}"\r\n'
        elif parts[0] == "flaky" and self._seen[key] <= int(parts[1]):
            status = int(parts[2]) if len(parts) > 2 else 503
        elif parts[0] == "status":
            status = int(parts[1])
            if status == 401:
                extra = 'WWW-Authenticate: Signature error="webhook_signature_invalid"\r\n'
        elif parts[0] == "delay":
            await asyncio.sleep(int(parts[1]) / 1000)
        elif parts[0] == "hang":
            status = None
        elif (parts[0] == "chaos" and self._random.random() * 100 < float(parts[1])
              and (len(parts) < 3 or self._chaos_given[key] < int(parts[2]))):
            self._chaos_given[key] += 1
            status = await self._chaos(writer)
        if kind == "webhook.challenge" and status == 200 and parts[0] != "noecho":
            answer = json.dumps({"challenge": key}).encode()  # proof of control: echo the value
            extra = "Content-Type: application/json\r\n"
        if self._log is not None:
            self._log.write(json.dumps({
                "t": time.time(), "path": target.split("?")[0], "key": key, "status": status,
                "sha256": hashlib.sha256(body).hexdigest(), "verified": problem is None and "signature" in headers,
                "problem": problem, "signature_input": headers.get("signature-input"),
                "keyid": headers.get("signature-input", "").partition('keyid="')[2].partition('"')[0] or None,
                "content_digest": headers.get("content-digest"), "type": kind,
                "subscriber_id": parsed.get("subscriber_id"),
                **({"body": body.decode("utf-8", "replace"), "authorization": headers.get("authorization")}
                   if self._log_bodies else {}),
            }) + "\n")
            self._log.flush()
        if status is None:
            await asyncio.sleep(3600)
        return status, extra, answer

    async def _chaos(self, writer: asyncio.StreamWriter) -> int | None:
        kind = self._random.choice(["500", "slow", "reset", "hang"])
        if kind == "slow":
            await asyncio.sleep(self._random.uniform(0.5, 3.0))
            return 200
        if kind == "reset":
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            raise ConnectionError("reset on purpose")
        return None if kind == "hang" else 500


async def serve(receiver: Receiver, port: int = 0, ssl_context: ssl.SSLContext | None = None) -> asyncio.Server:
    """Listen on 127.0.0.1:``port`` (0: any free port)."""
    return await asyncio.start_server(receiver.handle, "127.0.0.1", port, backlog=1024, ssl=ssl_context)
