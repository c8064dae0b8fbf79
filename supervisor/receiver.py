"""A local AdCP webhook receiver for the demo, the end-to-end tests and ``outboxd bench``.

It verifies every RFC 9421 signature independently of the daemon's signer (with the
``http_message_signatures`` library, or the ``adcp`` SDK's verifier when asked), records
every arrival as a JSON line, and behaves as the URL path says, so one process can play
healthy, flaky, hostile and hanging buyers at once:

    /ok                   200
    /flaky/N[/CODE]       CODE (default 503) for the first N arrivals of each key, then 200
    /status/CODE          always CODE (401 carries a webhook_signature_invalid challenge)
    /hang                 accepts and never answers
    /delay/MS             200 after MS milliseconds
    /chaos/PCT[/MAX]      PCT % of requests fail at random: 500, slow, reset or hang
                          (at most MAX times per idempotency key, if given)
    /noecho               200, but never echoes a webhook.challenge (every other path does)

Loopback only: it binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import hashlib
import json
import random
import socket
import struct
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

Verifier = Callable[[str, str, dict[str, str], bytes], str | None]


def library_verifier(public_jwks: dict[str, Any]) -> Verifier:
    """Verify with ``http_message_signatures`` (RFC 9421), AdCP webhook profile checks on top."""
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519
    from http_message_signatures import HTTPMessageVerifier, algorithms
    from http_message_signatures.resolvers import HTTPSignatureKeyResolver

    def _b64(value: str) -> bytes:
        return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))

    keys: dict[str, tuple[Any, Any]] = {}
    for jwk in public_jwks.get("keys", []):
        if jwk.get("kty") == "OKP":
            keys[jwk["kid"]] = (ed25519.Ed25519PublicKey.from_public_bytes(_b64(jwk["x"])), algorithms.ED25519)
        else:
            numbers = ec.EllipticCurvePublicNumbers(int.from_bytes(_b64(jwk["x"]), "big"),
                                                    int.from_bytes(_b64(jwk["y"]), "big"), ec.SECP256R1())
            keys[jwk["kid"]] = (numbers.public_key(), algorithms.ECDSA_P256_SHA256)

    class _Keys(HTTPSignatureKeyResolver):
        def resolve_public_key(self, key_id: str) -> Any:
            return keys[key_id][0]

    def verify(method: str, url: str, headers: dict[str, str], body: bytes) -> str | None:
        sig_input = headers.get("signature-input", "")
        if 'tag="adcp/webhook-signing/v1"' not in sig_input:
            return "webhook_signature_tag_invalid"
        kid = sig_input.split('keyid="', 1)[-1].split('"', 1)[0]
        if kid not in keys:
            return "webhook_signature_key_unknown"
        # AdCP webhook v1 sends Signature as unpadded base64url (adcp-webhooks.md §2.1);
        # RFC 8941 byte sequences are padded standard base64: translate before verifying.
        label, _, value = headers.get("signature", "").partition("=")
        raw = _b64(value.strip(":"))
        converted = {**headers, "signature": f"{label}=:{base64.b64encode(raw).decode()}:"}
        message = SimpleNamespace(method=method, url=url, headers=converted)
        try:
            HTTPMessageVerifier(signature_algorithm=keys[kid][1], key_resolver=_Keys()).verify(
                message, max_age=datetime.timedelta(seconds=360),
                expect_tag="adcp/webhook-signing/v1",
                require_components=("@method", "@target-uri", "@authority", "content-type", "content-digest"),
                body=body)
        except Exception as exc:
            return f"webhook_signature_invalid ({type(exc).__name__})"
        return None

    return verify


def adcp_verifier(public_jwks: dict[str, Any]) -> Verifier:
    """Verify with the ``adcp`` SDK's ``verify_webhook_signature`` and a static JWKS."""
    from adcp.signing import StaticJwksResolver  # adcp.webhooks would cost ~17 s to import
    from adcp.signing.webhook_verifier import WebhookVerifyOptions, verify_webhook_signature

    resolver = StaticJwksResolver(public_jwks)

    def verify(method: str, url: str, headers: dict[str, str], body: bytes) -> str | None:
        try:
            verify_webhook_signature(method=method, url=url, headers=headers, body=body,
                                     options=WebhookVerifyOptions(jwks_resolver=resolver))
        except Exception as exc:
            return getattr(exc, "code", None) or type(exc).__name__
        return None

    return verify


def served_jwks_verifier(jwks_urls: list[str], revocation_url: str | None = None,
                         issuer: str | None = None) -> Verifier:
    """The ``adcp`` SDK's verifier against the JWKS served right now: fetched again for every
    request (round robin over ``jwks_urls``), as by a buyer whose cache just expired; with
    ``revocation_url``, the SDK also fetches and checks the signed revocation list each time."""
    import httpx
    from adcp.signing import CachingRevocationChecker, FetchResult, InMemoryReplayStore, StaticJwksResolver
    from adcp.signing.webhook_verifier import WebhookVerifyOptions, verify_webhook_signature

    replays = InMemoryReplayStore()
    turn = iter(range(sys.maxsize))
    client = httpx.Client(timeout=5)  # one client: building one costs more than the fetch

    def fetch_list(uri: str, **_: Any) -> Any:
        return FetchResult(body=client.get(uri).json(), etag=None)

    def verify(method: str, url: str, headers: dict[str, str], body: bytes) -> str | None:
        try:
            resolver = StaticJwksResolver(client.get(jwks_urls[next(turn) % len(jwks_urls)]).json())
            revocations = None if revocation_url is None else CachingRevocationChecker(
                revocation_uri=revocation_url, issuer=issuer or "", jwks_resolver=resolver, fetcher=fetch_list)
            verify_webhook_signature(method=method, url=url, headers=headers, body=body, options=WebhookVerifyOptions(
                jwks_resolver=resolver, revocation_checker=revocations, replay_store=replays))
        except Exception as exc:
            return getattr(exc, "code", None) or type(exc).__name__
        return None

    return verify


class Receiver:
    def __init__(self, verifier: Verifier | None, log: IO[str] | None, *, seed: int = 0,
                 log_bodies: bool = False) -> None:
        self._verify = verifier
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
                head = f"HTTP/1.1 {status} X\r\nContent-Length: {len(answer)}\r\n{extra}\r\n"
                writer.write(head.encode() + answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _respond(self, method: str, target: str, headers: dict[str, str], body: bytes,
                       writer: asyncio.StreamWriter) -> tuple[int | None, str, bytes]:
        self.arrivals += 1
        url = f"http://{headers.get('host', '')}{target}"
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


async def serve(receiver: Receiver, port: int = 0) -> asyncio.Server:
    return await asyncio.start_server(receiver.handle, "127.0.0.1", port, backlog=1024)


def main(argv: list[str] | None = None) -> None:
    """``python -m supervisor.receiver --jwks FILE --port-file FILE --log FILE``"""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jwks", help="public JWKS to verify signatures with (omit: no verification)")
    parser.add_argument("--jwks-url", action="append",
                        help="verify with the adcp SDK against the JWKS served here now (repeatable: round robin)")
    parser.add_argument("--revocation-url", help="with --jwks-url: also check this signed revocation list")
    parser.add_argument("--revocation-issuer", help="the revocation list's expected issuer origin")
    parser.add_argument("--verifier", choices=["library", "adcp"], default="library")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", help="write the bound port here once listening")
    parser.add_argument("--log", help="append one JSON line per arrival here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-bodies", action="store_true", help="also log each body and Authorization header")
    args = parser.parse_args(argv)
    verifier = None
    if args.jwks_url:
        verifier = served_jwks_verifier(args.jwks_url, args.revocation_url, args.revocation_issuer)
    elif args.jwks:
        jwks = json.loads(Path(args.jwks).read_text())
        verifier = (adcp_verifier if args.verifier == "adcp" else library_verifier)(jwks)
    log = open(args.log, "a") if args.log else None

    async def run() -> None:
        server = await serve(Receiver(verifier, log, seed=args.seed, log_bodies=args.log_bodies), args.port)
        port = server.sockets[0].getsockname()[1]
        if args.port_file:
            tmp = Path(args.port_file + ".tmp")
            tmp.write_text(str(port))
            tmp.rename(args.port_file)
        print(port, flush=True)
        async with server:
            await server.serve_forever()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
