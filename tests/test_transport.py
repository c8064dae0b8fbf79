"""supervisor.wire.transport.HttpSender against real sockets on 127.0.0.1.

Every peer is a small asyncio server (tests/wire_peers.py), so each test controls the exact
bytes (and resets, stalls, garbage) a hostile receiver can produce. Host names such as
``buyer.test`` are answered by a stub resolver; nothing ever leaves loopback: the
``connects`` guard refuses (and records) any TCP connect to another address.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
import ssl
import struct
import time
import tracemalloc

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from supervisor.wire.transport import RESPONSE_BODY_CAP, _default_resolver
from tests.wire_peers import (BODY, HEADERS, IMPATIENT, answers_garbage, answers_late, hangs_up, loopback_settings,
                              never_answers, ok, resets, response, sends_half_a_body, trickles)
from tests.wire_peers import connects, event_loop_policy, peers, senders  # noqa: F401 - pytest fixtures

SECRET = "SECRET123456"


# --------------------------------------------------------------------------- happy path


async def test_keep_alive_reuses_one_connection(peers, senders) -> None:
    peer = await peers()
    sender = senders()
    for _ in range(3):
        result = await sender.post(f"http://127.0.0.1:{peer.port}/hook", BODY, HEADERS)
        assert result.status == 200 and result.error_kind is None and result.error is None
        assert result.body == b'{"ok":true}'
        assert result.headers["content-length"] == "11"
    assert peer.connections == 1
    assert [r.body for r in peer.requests] == [BODY] * 3
    assert peer.requests[0].line == "POST /hook HTTP/1.1"
    assert peer.requests[0].headers["content-type"] == "application/json"
    assert peer.requests[0].headers["accept-encoding"] == "identity"


async def test_pool_is_bounded_by_endpoint_concurrency(peers, senders) -> None:
    async def slow_ok(request, reader, writer) -> bool:  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.05)
        return await ok(request, reader, writer)

    peer = await peers(slow_ok)
    sender = senders(loopback_settings(endpoint_concurrency=2))
    results = await asyncio.gather(
        *(sender.post(f"http://127.0.0.1:{peer.port}/", BODY, HEADERS) for _ in range(8))
    )
    assert [r.status for r in results] == [200] * 8
    assert peer.connections == 2


async def test_redirect_is_returned_not_followed(peers, senders) -> None:
    async def redirect(request, reader, writer) -> bool:  # type: ignore[no-untyped-def]
        writer.write(response(302, b"", f"Location: http://127.0.0.1:{peer.port}/elsewhere\r\n"))
        await writer.drain()
        return True

    peer = await peers(redirect)
    result = await senders().post(f"http://127.0.0.1:{peer.port}/hook", BODY, HEADERS)
    assert result.status == 302 and result.error_kind is None
    assert result.headers["location"].endswith("/elsewhere")
    assert len(peer.requests) == 1


async def test_lru_evicts_and_closes_old_origins(peers, senders) -> None:
    first, second = await peers(), await peers()
    sender = senders(max_origins=1)
    assert (await sender.post(f"http://127.0.0.1:{first.port}/", BODY, HEADERS)).status == 200
    assert (await sender.post(f"http://127.0.0.1:{second.port}/", BODY, HEADERS)).status == 200
    assert list(sender._origins) == [f"http://127.0.0.1:{second.port}"]
    for _ in range(50):  # the evicted client's idle connection gets closed
        if not first._tasks:
            break
        await asyncio.sleep(0.01)
    assert not first._tasks
    assert (await sender.post(f"http://127.0.0.1:{first.port}/", BODY, HEADERS)).status == 200
    assert first.connections == 2


async def test_default_resolver_returns_address_strings() -> None:
    assert await _default_resolver("127.0.0.1", 443) == ["127.0.0.1"]


# --------------------------------------------------------------------------- SSRF


async def test_loopback_blocked_without_allowed_cidrs(peers, senders) -> None:
    peer = await peers()
    result = await senders(loopback_settings(allowed_cidrs=())).post(f"http://127.0.0.1:{peer.port}/", BODY, HEADERS)
    assert (result.status, result.error_kind) == (None, "blocked")
    assert result.error == "destination address is not allowed (loopback)"
    assert peer.connections == 0


async def test_private_name_blocked_and_resolver_text_never_leaks(peers, senders, connects) -> None:
    async def private(host: str, port: int) -> list[str]:
        return ["192.168.1.10"]

    async def broken(host: str, port: int) -> list[str]:
        raise socket.gaierror(-2, "Name or service not known: internal-dns-10.1.2.3")

    result = await senders(resolver=private).post("https://buyer.test/hook", BODY, HEADERS)
    assert (result.error_kind, result.error) == ("blocked", "destination address is not allowed (private)")
    result = await senders(resolver=broken).post("https://buyer.test/hook", BODY, HEADERS)
    assert result.error_kind == "connection_error"
    assert "10.1.2.3" not in (result.error or "") and "Name or service" not in (result.error or "")
    assert connects == []


async def test_any_blocked_answer_blocks_the_host(peers, senders) -> None:
    peer = await peers()

    async def mixed(host: str, port: int) -> list[str]:
        return ["127.0.0.1", "10.0.0.1"]

    result = await senders(resolver=mixed).post(f"http://buyer.test:{peer.port}/", BODY, HEADERS)
    assert result.error_kind == "blocked" and peer.connections == 0


async def test_http_blocked_unless_allow_http(peers, senders) -> None:
    peer = await peers()
    result = await senders(loopback_settings(allow_http=False)).post(f"http://127.0.0.1:{peer.port}/", BODY, HEADERS)
    assert result.error_kind == "blocked" and "https" in (result.error or "")
    assert peer.connections == 0
    for url in ("ftp://127.0.0.1/x", "not a url", "https://exa mple.com/"):
        assert (await senders().post(url, BODY, HEADERS)).error_kind == "blocked"


async def test_metadata_ip_blocked_even_inside_allowed_cidr(senders, connects) -> None:
    s = loopback_settings(allowed_cidrs=(ipaddress.ip_network("169.254.0.0/16"),))
    for url in ("https://169.254.169.254/latest/meta-data/", "http://169.254.169.254/"):
        result = await senders(s).post(url, BODY, HEADERS)
        assert (result.error_kind, result.error) == ("blocked", "destination address is not allowed (cloud metadata)")
    assert connects == []


async def test_ipv4_mapped_ipv6_literal_blocked(senders, connects) -> None:
    result = await senders(loopback_settings(allowed_cidrs=())).post("https://[::ffff:10.0.0.1]/hook", BODY, HEADERS)
    assert result.error_kind == "blocked" and "IPv4 embedded in IPv6" in (result.error or "")
    assert connects == []


class Rebinder:
    """A DNS stub for buyer.test: 127.0.0.1 first, then 10.0.0.1 (a rebinding attack)."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        assert host == "buyer.test"
        self.calls += 1
        return ["127.0.0.1"] if self.calls == 1 else ["10.0.0.1"]


async def test_dns_rebinding_pinned_address_is_reused(peers, senders, connects) -> None:
    peer = await peers()
    resolver = Rebinder()
    sender = senders(resolver=resolver, dns_ttl_seconds=3600)
    for _ in range(4):
        result = await sender.post(f"http://buyer.test:{peer.port}/hook?x=1", BODY, HEADERS)
        assert result.status == 200
    assert resolver.calls == 1
    assert [r.headers["host"] for r in peer.requests] == [f"buyer.test:{peer.port}"] * 4
    assert peer.requests[0].line == "POST /hook?x=1 HTTP/1.1"
    assert set(connects) == {"127.0.0.1"}


async def test_dns_rebinding_after_ttl_is_blocked(peers, senders, connects) -> None:
    peer = await peers()
    sender = senders(resolver=Rebinder(), dns_ttl_seconds=0)
    assert (await sender.post(f"http://buyer.test:{peer.port}/hook", BODY, HEADERS)).status == 200
    second = await sender.post(f"http://buyer.test:{peer.port}/hook", BODY, HEADERS)
    assert (second.error_kind, second.error) == ("blocked", "destination address is not allowed (private)")
    assert len(peer.requests) == 1
    assert "10.0.0.1" not in connects


# --------------------------------------------------------------------------- TLS


def _self_signed(host: str) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


async def test_https_sni_uses_url_host_while_connecting_to_pinned_ip(peers, senders, tmp_path, connects) -> None:
    cert_pem, key_pem = _self_signed("buyer.test")
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key_pem)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    sni: list[str | None] = []
    server_ctx.sni_callback = lambda sslobj, name, ctx: sni.append(name)  # type: ignore[assignment,misc,return-value]
    peer = await peers(ssl_context=server_ctx)

    async def resolver(host: str, port: int) -> list[str]:
        return {"buyer.test": ["127.0.0.1"]}[host]

    client_ctx = ssl.create_default_context(cadata=cert_pem.decode())
    sender = senders(loopback_settings(allow_http=False), resolver=resolver, verify=client_ctx)
    for _ in range(2):
        result = await sender.post(f"https://buyer.test:{peer.port}/hook", BODY, HEADERS)
        assert result.status == 200, result
    assert sni == ["buyer.test"] and peer.connections == 1
    assert peer.requests[0].headers["host"] == f"buyer.test:{peer.port}"
    assert set(connects) == {"127.0.0.1"}

    # The same server under another name: the certificate check must fail, not be skipped.
    async def other(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]

    wrong = await senders(loopback_settings(allow_http=False), resolver=other, verify=client_ctx).post(
        f"https://other.test:{peer.port}/hook?token={SECRET}", BODY, HEADERS
    )
    assert wrong.error_kind == "connection_error"
    assert wrong.error == "ConnectError: TLS certificate name mismatch (not valid for this host)"
    # A file path works as verify too.
    by_path = senders(loopback_settings(allow_http=False), resolver=resolver, verify=str(tmp_path / "cert.pem"))
    assert (await by_path.post(f"https://buyer.test:{peer.port}/", BODY, HEADERS)).status == 200


@pytest.mark.parametrize(
    ("handler", "kind", "error", "max_seconds"),
    [
        (resets, "connection_error", "ReadError: connection reset by peer", 0.5),
        (never_answers, "timeout", "ReadTimeout: no response data within the read timeout", 1.0),
        (answers_late, "timeout", "ReadTimeout: no response data within the read timeout", 1.0),
        (answers_garbage, "protocol_error", "RemoteProtocolError: response is not valid HTTP/1.1", 0.5),
        (sends_half_a_body, "connection_error",
         "RemoteProtocolError: connection closed before the response was complete", 0.5),
        (hangs_up, "connection_error", "RemoteProtocolError: connection closed before the response was complete", 0.5),
        (trickles, "timeout", "DeadlineExceeded: attempt exceeded connect + read timeout", 1.5),
    ],
    ids=["reset", "never-answers", "slower-than-timeout", "garbage", "closed-mid-body", "closed-no-response",
         "trickle"],
)
async def test_hostile_receiver(peers, senders, handler, kind, error, max_seconds) -> None:
    peer, sender = await peers(handler), senders(loopback_settings(**IMPATIENT))  # building it is not the POST
    started = time.monotonic()
    result = await sender.post(f"http://127.0.0.1:{peer.port}/hook?token={SECRET}", BODY, HEADERS)
    took = time.monotonic() - started
    assert (result.status, result.error_kind, result.error) == (None, kind, error)
    assert result.body == b"" and dict(result.headers) == {}
    assert took < max_seconds and abs(result.elapsed_ms - took * 1000) < 50
    assert len(peer.requests) == 1


async def test_deadline_frees_the_pool_slot(peers, senders) -> None:
    calls = 0

    async def trickle_once(request, reader, writer) -> bool:  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 1:
            return await trickles(request, reader, writer)
        return await ok(request, reader, writer)

    peer = await peers(trickle_once)
    sender = senders(loopback_settings(endpoint_concurrency=1, **IMPATIENT))
    first = await sender.post(f"http://127.0.0.1:{peer.port}/", BODY, HEADERS)
    assert first.error_kind == "timeout"
    second = await sender.post(f"http://127.0.0.1:{peer.port}/", BODY, HEADERS)
    assert second.status == 200 and peer.connections == 2


async def test_header_injection_is_a_local_protocol_error(peers, senders) -> None:
    peer = await peers()
    bad = {"Content-Type": "application/json", "X-Evil": f"a\r\nX-Token: {SECRET}"}
    result = await senders().post(f"http://127.0.0.1:{peer.port}/", BODY, bad)
    assert (result.error_kind, result.error) == (
        "protocol_error",
        "LocalProtocolError: request could not be encoded as valid HTTP",
    )
    assert peer.requests == []


async def test_connection_refused(senders) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = await senders().post(f"http://127.0.0.1:{port}/?token={SECRET}", BODY, HEADERS)
    assert (result.error_kind, result.error) == ("connection_error", "ConnectError: connection refused")


async def test_huge_body_is_capped_and_not_read(peers, senders) -> None:
    total = 5 * 1024 * 1024
    chunk = b"y" * 65536

    async def huge(request, reader, writer) -> bool:  # type: ignore[no-untyped-def]
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {total}\r\n\r\n".encode())
        for _ in range(total // len(chunk)):
            writer.write(chunk)
            await writer.drain()
        return True

    peer = await peers(huge)
    sender = senders()
    tracemalloc.start()
    try:
        started = time.monotonic()
        result = await sender.post(f"http://127.0.0.1:{peer.port}/", BODY, HEADERS)
        took = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.status == 200 and result.error_kind is None
    assert len(result.body) == RESPONSE_BODY_CAP and set(result.body) == {ord("y")}
    assert took < 0.5
    assert peak < 1024 * 1024, peak  # nowhere near 5 MiB held in memory
    # The unread connection is discarded, not reused with 5 MiB pending in it.
    assert (await sender.post(f"http://127.0.0.1:{peer.port}/", BODY, HEADERS)).status == 200
    assert peer.connections == 2


async def test_retry_after_is_passed_through(peers, senders) -> None:
    async def busy(request, reader, writer) -> bool:  # type: ignore[no-untyped-def]
        writer.write(response(503, b"busy", "Retry-After: 120\r\nX-Mixed-Case: Yes\r\n"))
        await writer.drain()
        return True

    peer = await peers(busy)
    result = await senders().post(f"http://127.0.0.1:{peer.port}/", BODY, HEADERS)
    assert (result.status, result.body, result.error_kind) == (503, b"busy", None)
    assert result.headers["retry-after"] == "120" and result.headers["x-mixed-case"] == "Yes"


async def test_errors_never_contain_the_query_string(peers, senders) -> None:
    async def private(host: str, port: int) -> list[str]:
        return ["10.9.8.7"]

    peer = await peers(answers_garbage)
    cases = [
        await senders().post(f"http://127.0.0.1:{peer.port}/p?token={SECRET}", BODY, HEADERS),
        await senders(resolver=private).post(f"https://buyer.test/p?token={SECRET}", BODY, HEADERS),
        await senders(loopback_settings(allow_http=False)).post(f"http://127.0.0.1:1/p?token={SECRET}", BODY, HEADERS),
        await senders().post(f"http://127.0.0.1:1/p?token={SECRET}", BODY, HEADERS),
        await senders().post(f"http://127.0.0.1:99999/p?token={SECRET}", BODY, HEADERS),
    ]
    for result in cases:
        assert result.error_kind is not None
        assert result.error and len(result.error) <= 200
        assert SECRET not in result.error and "token" not in result.error and "10.9.8.7" not in result.error
        assert SECRET not in repr(result)


async def test_closed_sender_refuses(senders) -> None:
    sender = senders()
    await sender.aclose()
    with pytest.raises(RuntimeError):
        await sender.post("https://buyer.test/", BODY, HEADERS)


async def test_a_connection_handed_to_a_waiter_that_gave_up_goes_back_to_the_pool(senders) -> None:
    """The pool's hand-over race: a waiter that gives up (cancelled, or its pool timeout: one
    handler serves both) in the same loop turn as a connection was handed to it must not take
    that connection, or its slot, with it."""
    from supervisor.wire.http1 import Http1Connection
    from supervisor.wire.transport import _Origin, _target

    sender = senders(loopback_settings(endpoint_concurrency=1))
    entry = _Origin(_target("http://127.0.0.1:1/"), opened=1)  # its one connection is in use
    waiting = asyncio.ensure_future(sender._checkout(entry))
    await asyncio.sleep(0)
    assert len(entry.waiters) == 1
    connection = Http1Connection(asyncio.get_running_loop(), RESPONSE_BODY_CAP)
    sender._checkin(entry, connection, True)  # handed over ...
    waiting.cancel()  # ... and the waiter gives up before it runs again
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert entry.idle == [connection] and entry.opened == 1 and not entry.waiters


def _answer_then_close(head: bytes, ending: str):  # type: ignore[no-untyped-def]
    async def answer(request, reader, writer) -> bool:  # type: ignore[no-untyped-def]
        writer.write(head + b'{"ok":true}')
        await writer.drain()
        await asyncio.sleep(0.05)
        if ending == "reset":
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        return False
    return answer


@pytest.mark.parametrize(("head", "ending"), [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\n", "close"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "close"),
    (b"HTTP/1.1 200 OK\r\n\r\n", "reset"),
    (b"HTTP/1.0 200 OK\r\n\r\n", "close"),
], ids=["identity-coding", "gzip-coding", "no-length-then-reset", "http-1.0"])
async def test_a_body_the_close_delimits_is_the_whole_answer_however_the_connection_ends(
        peers, senders, head, ending) -> None:
    """RFC 9112 section 6.3: a response without a length or a final chunked coding runs to the close."""
    peer = await peers(_answer_then_close(head, ending))
    result = await senders().post(f"http://127.0.0.1:{peer.port}/hook", BODY, HEADERS)
    assert (result.status, result.error_kind, result.error) == (200, None, None)
    assert len(peer.requests) == 1


async def test_a_tls_handshake_that_never_ends_is_named_so(senders) -> None:
    """TCP connected, the handshake never answered: not the connect timeout a firewall gives."""
    async def silent(reader, writer) -> None:  # type: ignore[no-untyped-def]
        await reader.read()  # reads the ClientHello, answers nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        result = await senders(loopback_settings(**IMPATIENT)).post(f"https://127.0.0.1:{port}/hook", BODY, HEADERS)
    finally:
        server.close()
    assert (result.error_kind, result.error) == ("timeout", "ConnectTimeout: TLS handshake timed out (connected)")
