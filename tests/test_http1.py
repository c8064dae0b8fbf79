"""supervisor.wire.http1: the daemon's HTTP/1.1 connection, differentially against h11.

h11 (the pure-Python parser under httpx) is the oracle: hypothesis writes responses with
every framing HTTP/1.1 allows (Content-Length, chunked with extensions and trailers, a body
delimited by the close, interim 1xx answers first), splits them at random points, and the
connection must read the same status, headers and body as h11 does, and reuse the
connection exactly when h11 says the exchange left it reusable. Garbage must always end
as a failure from the fixed vocabulary. A few socket-level cases follow.
"""

from __future__ import annotations

import asyncio

import h11
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from supervisor.wire.http1 import ERROR_BODY_KEPT, Http1Connection, Response, TransportFailure, encode_request
from supervisor.wire.transport import HttpSender
from tests.wire_peers import BODY, HEADERS, loopback_settings, ok, response
from tests.wire_peers import event_loop_policy, peers, senders  # noqa: F401 - pytest fixtures

CAP = 1024
KINDS = {"timeout", "connection_error", "protocol_error"}


class FakeTransport(asyncio.Transport):
    """Collects what the connection writes; records how it was closed."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closing: str | None = None

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.written += data

    def is_closing(self) -> bool:
        return self.closing is not None

    def abort(self) -> None:
        self.closing = self.closing or "abort"

    def close(self) -> None:
        self.closing = self.closing or "close"


async def exchange(chunks: list[bytes], eof: bool, read_timeout: float = 5.0
                   ) -> tuple[int, dict[str, str], bytes, bool] | TransportFailure:
    loop = asyncio.get_running_loop()
    connection = Http1Connection(loop, CAP)
    connection.connection_made(FakeTransport())
    request = asyncio.ensure_future(connection.request(b"POST / HTTP/1.1\r\nHost: x\r\n\r\n", read_timeout))
    await asyncio.sleep(0)
    for chunk in chunks:
        if connection.closed:
            break
        connection.data_received(chunk)
    if eof and not connection.closed:
        connection.connection_lost(None)
    try:
        return await asyncio.wait_for(request, 1.0)
    except TransportFailure as failure:
        return failure


def _kept(status: int) -> int:
    return CAP if 200 <= status <= 299 else ERROR_BODY_KEPT


def oracle(raw: bytes, eof: bool) -> tuple[int, dict[str, str], bytes, bool] | None:
    """What h11 reads from ``raw``: (status, headers, body, reusable), or None if it is not a response.

    Reading stops at CAP bytes of body; of a non-2xx answer only the first ERROR_BODY_KEPT are kept."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="POST", target="/", headers=[("Host", "x"), ("Content-Length", "0")]))
    client.send(h11.EndOfMessage())
    client.receive_data(raw)
    if eof:
        client.receive_data(b"")
    status, headers, body = 0, {}, b""
    try:
        while True:
            event = client.next_event()
            if isinstance(event, h11.Response):
                status = event.status_code
                for name, value in event.headers:
                    key, text = name.decode("latin-1").lower(), value.decode("latin-1")
                    headers[key] = text if key not in headers else f"{headers[key]}, {text}"
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) >= CAP:
                    return status, headers, body[:_kept(status)], False
            elif isinstance(event, h11.EndOfMessage):
                reusable = client.our_state is h11.DONE and client.their_state is h11.DONE
                return status, headers, body[:_kept(status)], reusable and not eof
            elif event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                return None
    except h11.RemoteProtocolError:
        return None


TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_", min_size=1, max_size=12)
VALUE = st.text(alphabet="".join(chr(c) for c in range(0x21, 0x7F)), max_size=20)
FRAMING = ("length", "chunked", "close")


@st.composite
def responses(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A well-formed response, framed one of the three ways, and whether the peer closes after it."""
    status = draw(st.integers(200, 599).filter(lambda s: s not in (204, 304)))
    headers = draw(st.lists(st.tuples(TOKEN, VALUE), max_size=5).map(
        lambda hs: [(n, v) for n, v in hs if n.lower() not in ("content-length", "transfer-encoding", "connection")]))
    body = draw(st.binary(max_size=3 * CAP))
    framing = draw(st.sampled_from(FRAMING))
    close = draw(st.booleans()) or framing == "close"
    lines = [f"HTTP/1.1 {status} {draw(st.sampled_from(['OK', 'X', '']))}".rstrip(" ")]
    interim = draw(st.sampled_from([b"", b"HTTP/1.1 100 Continue\r\n\r\n",
                                    b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"]))
    lines += [f"{n}: {v}" for n, v in headers]
    if close:
        lines.append("Connection: close")
    if framing == "length":
        lines.append(f"Content-Length: {len(body)}")
        payload = body
    elif framing == "chunked":
        lines.append("Transfer-Encoding: chunked")
        sizes = draw(st.lists(st.integers(1, 700), max_size=8))
        payload, rest = b"", body
        for size in sizes:
            piece, rest = rest[:size], rest[size:]
            if piece:
                payload += (f"{len(piece):x}".encode() + draw(st.sampled_from([b"", b";ext=1"]))
                            + b"\r\n" + piece + b"\r\n")
        if rest:
            payload += f"{len(rest):X}\r\n".encode() + rest + b"\r\n"
        payload += b"0\r\n" + draw(st.sampled_from([b"", b"Trailer-X: 1\r\n"])) + b"\r\n"
    else:
        payload = body
    return interim + ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload, close


def split(raw: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(raw) + 1) for c in cuts})
    return [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)]) if raw[a:b]]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(responses(), st.lists(st.integers(0, 10_000), max_size=6))
# A failed answer longer than what is kept of it, within the cap (reused) and past it (dropped).
@example((b"HTTP/1.1 503 X\r\nContent-Length: 600\r\n\r\n" + b"b" * 600, False), [100, 300])
@example((b"HTTP/1.1 503 X\r\nContent-Length: 2000\r\n\r\n" + b"b" * 2000, False), [7])
def test_reads_every_framing_as_h11_does(case: tuple[bytes, bool], cuts: list[int]) -> None:
    raw, close = case
    expected = oracle(raw, eof=close)
    assert expected is not None, "the generator wrote a response h11 cannot read"
    got = asyncio.run(exchange(split(raw, cuts), eof=close))
    assert not isinstance(got, TransportFailure), got.error
    assert got[:3] == expected[:3]
    assert got[3] == expected[3]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.builds(lambda head, tail: b"HTTP/1.1 " + head + b"\r\n" + tail,
                                          st.binary(max_size=40), st.binary(max_size=200)),
       st.lists(st.integers(0, 1000), max_size=4), st.booleans())
def test_garbage_ends_in_the_fixed_vocabulary(raw: bytes, cuts: list[int], eof: bool) -> None:
    got = asyncio.run(exchange(split(raw, cuts), eof=eof, read_timeout=0.01))  # incomplete: a read timeout
    if isinstance(got, TransportFailure):
        assert got.kind in KINDS and got.error.split(":")[0] in {"RemoteProtocolError", "ReadTimeout", "ReadError"}
    else:  # llhttp accepted it: then h11 must read the same answer
        expected = oracle(raw, eof=eof)
        if expected is not None:
            assert got[:3] == expected[:3]


def test_interim_answers_are_skipped_and_bytes_after_the_answer_drop_the_connection() -> None:
    raw = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n"
    got = asyncio.run(exchange([raw], eof=False))
    assert not isinstance(got, TransportFailure)
    assert got[0] == 201 and got[2] == b"ok" and got[3] is False


# --------------------------------------------------------------------------- bytes after the answer

# The next request's own answer; its leading blank line (skipped before a status line, RFC
# 9112 section 2.2) would end the unfinished head of a stray response instead.
MINE = b"\r\nHTTP/1.1 299 Mine\r\nContent-Length: 4\r\n\r\nmine"
SWALLOWER = f"HTTP/1.1 200 OK\r\nContent-Length: {len(MINE) - 2}\r\n".encode()  # its body would be MINE
# What a receiver may write after its answer: the start of another response (whose body
# would swallow the next real answer), a whole one, a stray line, junk, blank lines.
EXTRA = st.sampled_from([SWALLOWER, SWALLOWER + b"\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
                         b"HTTP/1.1 200 OK\r\n", b"H", b"\r\n", b"\n\n"]) | st.binary(min_size=1, max_size=40)


async def answer_then_next(chunks: list[bytes], eof: bool) -> tuple[Response | TransportFailure, Response | None, bool]:
    """The first answer read from ``chunks``; then, unless the connection was dropped, what a
    second request on the same connection reads when its own answer is :data:`MINE`."""
    loop = asyncio.get_running_loop()
    connection = Http1Connection(loop, CAP)
    connection.connection_made(FakeTransport())
    first: Response | TransportFailure
    request = asyncio.ensure_future(connection.request(b"POST / HTTP/1.1\r\nHost: x\r\n\r\n", 5.0))
    await asyncio.sleep(0)
    for chunk in chunks:  # every chunk arrives before the next request is written
        if not connection.closed:
            connection.data_received(chunk)
        await asyncio.sleep(0)  # reads on either side of the caller taking its answer
    if eof and not connection.closed:
        connection.connection_lost(None)
    try:
        first = await asyncio.wait_for(request, 1.0)
    except TransportFailure as failure:
        first = failure
    if connection.closed:
        return first, None, True
    second = asyncio.ensure_future(connection.request(b"POST / HTTP/1.1\r\nHost: x\r\n\r\n", 5.0))
    await asyncio.sleep(0)
    connection.data_received(MINE)
    return first, await asyncio.wait_for(second, 1.0), False


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(responses(), EXTRA, st.lists(st.integers(0, 10_000), max_size=6), st.booleans())
def test_bytes_after_an_answer_are_never_read_by_a_later_request(
        case: tuple[bytes, bool], extra: bytes, cuts: list[int], at_the_boundary: bool) -> None:
    """The answer is what h11 reads; whatever follows it, however split, drops the
    connection (RFC 9112 section 6.3) and so can never be read as another request's answer."""
    raw, close = case
    expected = oracle(raw, eof=close)
    assert expected is not None
    chunks = split(raw + extra, cuts + ([len(raw)] if at_the_boundary else []))
    first, second, dropped = asyncio.run(answer_then_next(chunks, eof=close))
    if b"Content-Length" not in raw and b"chunked" not in raw:  # a body delimited by the close: extra is body
        assert not isinstance(first, TransportFailure) and first[2] == (raw + extra).split(b"\r\n\r\n", 1 + (
            raw.startswith(b"HTTP/1.1 1")))[-1][:CAP] and dropped
        return
    assert not isinstance(first, TransportFailure), first.error
    assert first[:3] == expected[:3], "the answer is the response's own, not the bytes after it"
    assert dropped and second is None, "bytes after the answer: the connection is never reused"


def test_every_split_of_an_answer_and_the_start_of_another_drops_the_connection() -> None:
    """Exhaustively, every one- and two-cut split of a 200 followed by most of the head of
    another response, whose body would be the next real answer."""
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" + SWALLOWER

    async def every_split() -> int:
        count = 0
        for a in range(1, len(raw)):
            for b in range(a, len(raw)):
                first, second, dropped = await answer_then_next(split(raw, [a, b]), eof=False)
                assert not isinstance(first, TransportFailure) and first[0] == 200 and first[2] == b"ok"
                assert dropped and second is None, (a, b)
                count += 1
        return count

    assert asyncio.run(every_split()) == (len(raw) - 1) * len(raw) // 2


def test_upgrade_is_not_an_answer() -> None:
    raw = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n"
    got = asyncio.run(exchange([raw], eof=False))
    assert isinstance(got, TransportFailure) and got.kind == "protocol_error"


@given(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=4))
def test_a_header_that_could_smuggle_another_is_refused(headers: dict[str, str]) -> None:
    """Names must be tokens, values free of CR, LF and other controls; framing is ours."""
    try:
        data = encode_request("/p?q=1", "buyer.example", headers, b"{}", {"User-Agent": "outboxd"})
    except TransportFailure as failure:
        assert failure.kind == "protocol_error"
        return
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    assert head[0] == "POST /p?q=1 HTTP/1.1" and head[1] == "Host: buyer.example"
    assert head[-1] == "Content-Length: 2"
    assert len(head) == 3 + len({n.lower() for n in headers if n.lower() not in
                                 ("host", "content-length", "transfer-encoding", "connection")} | {"user-agent"})


# --------------------------------------------------------------------------- over sockets


async def test_chunked_answer_over_a_socket_keeps_the_connection(peers, senders) -> None:  # noqa: F811
    async def chunked(request, reader, writer) -> bool:  # type: ignore[no-untyped-def]
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n")
        await writer.drain()
        return True

    peer = await peers(chunked)
    sender = senders()
    for _ in range(2):
        result = await sender.post(f"http://127.0.0.1:{peer.port}/", BODY, HEADERS)
        assert (result.status, result.body) == (200, b"ok")
    assert peer.connections == 1


async def test_a_connection_the_receiver_closed_while_idle_is_not_reused(peers, senders) -> None:  # noqa: F811
    async def once(request, reader, writer) -> bool:  # type: ignore[no-untyped-def]
        await ok(request, reader, writer)
        return False  # answer, then close the idle keep-alive connection

    peer = await peers(once)
    sender = senders()
    assert (await sender.post(f"http://127.0.0.1:{peer.port}/", BODY, HEADERS)).status == 200
    await asyncio.sleep(0.05)  # the close reaches us while the connection is idle
    assert (await sender.post(f"http://127.0.0.1:{peer.port}/", BODY, HEADERS)).status == 200
    assert peer.connections == 2


async def test_connection_close_answer_is_not_reused(peers, senders) -> None:  # noqa: F811
    async def closing(request, reader, writer) -> bool:  # type: ignore[no-untyped-def]
        writer.write(response(200, b"ok", "Connection: close\r\n"))
        await writer.drain()
        return True  # the server would keep it; the client must not

    peer = await peers(closing)
    sender: HttpSender = senders(loopback_settings())
    for _ in range(2):
        assert (await sender.post(f"http://127.0.0.1:{peer.port}/", BODY, HEADERS)).status == 200
    assert peer.connections == 2


@pytest.mark.parametrize("tail", ["/a b", "/caf\u00e9", "/%7e"])
async def test_only_a_canonical_target_is_sent(peers, senders, tail: str) -> None:  # noqa: F811
    peer = await peers()
    result = await senders().post(f"http://127.0.0.1:{peer.port}{tail}", BODY, HEADERS)
    assert result.error_kind in ("invalid", "blocked") and peer.requests == []


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\r\nX-Endless: " + b"a" * 70_000,  # a header that never ends
    b"HTTP/1.1 100 Continue\r\n\r\n" * 5_000,  # interim answers without end
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    + (b"1;ext=" + b"e" * 2_000 + b"\r\nx\r\n") * 1_000,  # 2 KB of chunk extension per body byte
], ids=["endless-header", "endless-interim", "wasteful-chunks"])
def test_a_response_cannot_make_the_daemon_buffer_without_bound(raw: bytes) -> None:
    """llhttp buffers a header until it ends: the head may take 64 KiB, the exchange 1 MiB."""
    got = asyncio.run(exchange(split(raw, list(range(4096, len(raw), 4096))), eof=False))
    assert isinstance(got, TransportFailure), got
    assert got.error == "RemoteProtocolError: response head or framing too large"


@pytest.mark.parametrize("body", [b"", b"ok", b"ok\r\n", b"\r\n\r\n", b"\n"])
@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_blank_lines_after_an_answer_drop_it_however_the_reads_fall(body: bytes, framing: str) -> None:
    """The parser skips CR and LF between messages silently; they still drop the connection,
    while an answer whose own framing or body ends in them keeps it, for every one-cut split
    and for one byte per read."""
    if framing == "length":
        raw = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    else:
        raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + (
            b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"

    async def every_split() -> None:
        for extra in (b"", b"\r\n", b"\n", b"\r\n\r\n"):
            stream = raw + extra
            splits = [split(stream, [cut]) for cut in range(len(stream) + 1)] + [[bytes([b]) for b in stream]]
            for chunks in splits:
                first, second, dropped = await answer_then_next(chunks, eof=False)
                assert not isinstance(first, TransportFailure) and first[2] == body
                assert dropped == bool(extra), (extra, chunks)
                assert dropped or (second is not None and second[0] == 299)

    asyncio.run(every_split())


async def test_an_answer_followed_by_the_start_of_another_never_answers_the_next_request(peers, senders  # noqa: F811
                                                                                         ) -> None:
    """One write holds a whole 200 and most of the head of another, whose body would be the
    next real answer: the next request is answered by its own 503."""
    async def two_in_one_write(request, reader, writer) -> bool:  # type: ignore[no-untyped-def]
        refusal = b"\r\n" + response(503, b"busy")  # would end the stray head, were it still read
        if len(peer.requests) == 1:
            writer.write(response(200, b"ok") + f"HTTP/1.1 200 OK\r\nContent-Length: {len(refusal) - 2}\r\n".encode())
        else:
            writer.write(refusal)
        await writer.drain()
        return True

    peer = await peers(two_in_one_write)
    sender = senders()
    first = await sender.post(f"http://127.0.0.1:{peer.port}/", BODY, HEADERS)
    second = await sender.post(f"http://127.0.0.1:{peer.port}/", BODY, HEADERS)
    assert (first.status, first.body) == (200, b"ok")
    assert (second.status, second.body) == (503, b"busy")
    assert peer.connections == 2, "the connection with bytes after its answer was closed, never pooled"
