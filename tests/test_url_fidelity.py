"""URL fidelity, differentially: what enqueue accepts is what is signed, sent and verified.

Every generated URL goes through the producer's ``validate_destination`` (refused ones must
raise ``OutboxValidationError`` naming ``url``, and only for the reasons listed in the
docs/enqueue.md, "URL rules"), is signed by the daemon's signer, POSTed by the real ``HttpSender`` to
the project's receiver on 127.0.0.1, which rebuilds the URL from the request line and
``Host`` and verifies with the adcp SDK's ``verify_webhook_signature``. One receiver and
one sender serve every example (keep-alive), so 500 examples take a few seconds.

``pytest --hypothesis-profile=slow tests/test_url_fidelity.py`` runs 5,000 examples.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from outbox.errors import OutboxValidationError
from outbox.urls import canonicalize_url, endpoint_origin, validate_destination
from outboxd_receiver import Receiver, adcp_verifier, serve
from supervisor.wire.classify import classify_transport_error
from supervisor.wire.signing import ALG_ED25519, SigningKey, signature_headers
from supervisor.wire.transport import HttpSender
from tests.ledger import PRODUCER

T = TypeVar("T")
KEY = SigningKey("fidelity-key", ALG_ED25519, Ed25519PrivateKey.generate())
BODY = b'{"idempotency_key":"whk_fidelity_0001","status":"completed"}'
# Six fixed segments: the generated path has at most five, so its ".." segments can never
# climb out to the receiver's behaviour-by-path routes (/hang, /status/...).
PREFIX = "/w/w/w/w/w/w"
EXAMPLES = max(500, settings.default.max_examples)  # the "slow" profile (tests/conftest.py) asks 5,000

# The RFC 3986 repertoire, plus what buyers paste that is not in it.
UNRESERVED = "ABCXYZabcxyz0189-._~"
SUB_DELIMS = "!$&'()*+,;="
HTTPX_ESCAPES = '"<>{}`'  # httpx would percent-encode these itself
NOT_IN_URIS = "[]|^"  # gen-delims illegal in a path/query, and other ASCII RFC 3986 excludes
REFUSED = ["\\", "#", "%", " "]  # backslash, fragment, stray escape, whitespace: rarer, so most URLs go out
ESCAPES = st.builds(
    lambda byte, upper: f"%{byte:02X}" if upper else f"%{byte:02x}",
    st.integers(0, 255) | st.sampled_from([0x2E, 0x41, 0x7E, 0x2F, 0x25, 0x3F, 0x23]),  # %2E %41 %7E %2F ...
    st.booleans(),
)
NON_ASCII = st.characters(min_codepoint=0x80, max_codepoint=0x10FFFF, exclude_categories=("Cs",))
CHAR = st.one_of(
    st.sampled_from(UNRESERVED),
    st.sampled_from(SUB_DELIMS + ":@"),
    ESCAPES,
    st.sampled_from(list(HTTPX_ESCAPES + NOT_IN_URIS) * 4 + REFUSED),
    NON_ASCII,
)
SEGMENT = st.one_of(
    st.lists(CHAR, max_size=5).map("".join),
    st.sampled_from([".", "..", "%2E", ".%2e", "...", "%2E%2E%2E", "~user", "a%2Fb", "caf\u00e9", "%E2%82%AC",
                     "%7e%41", "a+b", "", "x;v=1", "@:", "%2e%2ex"]),
)
PATH = st.lists(SEGMENT, max_size=5).map(lambda s: "".join("/" + x for x in s))
QUERY = st.none() | st.lists(
    st.tuples(st.lists(CHAR | st.sampled_from("/?"), max_size=4).map("".join),
              st.lists(CHAR | st.sampled_from("/?="), max_size=6).map("".join)),
    max_size=4,
).map(lambda pairs: "&".join(f"{k}={v}" for k, v in pairs))


def refusal_expected(path: str, query: str | None) -> str | None:
    """The docs/enqueue.md "URL rules" refusal class a raw path and query falls in, if any."""
    raw = path + ("" if query is None else "?" + query)
    if re.search(r"[\s\x00-\x1f\x7f]", raw):
        return "whitespace or control character"
    if "\\" in raw:
        return "backslash"
    if "#" in raw:
        return "fragment"
    if re.search(r"%(?![0-9a-fA-F]{2})", raw):
        return "stray %"
    if any("%" in s and re.sub("%2[eE]", ".", s) in (".", "..") for s in path.split("/")):
        return "%2E dot segment"
    return None


@dataclass
class Harness:
    """One event loop in a thread, one receiver and one sender, shared by every example."""

    loop: asyncio.AbstractEventLoop
    port: int
    sender: HttpSender
    arrived: list[str] = field(default_factory=list)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    sdk = adcp_verifier({"keys": [KEY.public_jwk()]})
    arrived: list[str] = []

    def verify(method: str, url: str, headers: dict[str, str], body: bytes) -> str | None:
        arrived.append(url)  # the URL the receiver rebuilt from the request line and Host
        return sdk(method, url, headers, body)

    async def start() -> tuple[asyncio.Server, HttpSender]:
        return await serve(Receiver(verify, None)), HttpSender(PRODUCER)

    server, sender = asyncio.run_coroutine_threadsafe(start(), loop).result()
    h = Harness(loop, server.sockets[0].getsockname()[1], sender, arrived)
    yield h

    async def stop() -> None:
        await sender.aclose()
        server.close()
        await server.wait_closed()

    h.run(stop())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def deliver(h: Harness, url: str) -> tuple[int | None, str | None, str | None]:
    """Sign ``url``, POST to it; (status, error kind, URL the receiver verified against)."""
    del h.arrived[:]
    result = h.run(h.sender.post(url, BODY, signature_headers(KEY, url=url, body=BODY)))
    return result.status, result.error_kind, (h.arrived[-1] if h.arrived else None)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=PATH, query=QUERY)
@example(path="/caf\u00e9/\u20ac", query="q=\u00fc")  # non-ASCII path and query
@example(path="/a+b/~me", query="x=a+b&x=c&x=")  # '+', '~', repeated parameters
@example(path="/a%2Fb/%2f", query="next=%2F")  # encoded slashes stay encoded
@example(path="/%7e%41/./x/../y", query="k=%7e")  # escaped unreserved, dot segments
@example(path="/{id}/<x>", query='f={"a":1}')  # characters httpx escapes itself
def test_accepted_urls_verify_refused_ones_name_url(harness: Harness, path: str, query: str | None) -> None:
    raw = f"http://127.0.0.1:{harness.port}{PREFIX}{path}" + ("" if query is None else f"?{query}")
    expected = refusal_expected(path, query)
    event(f"refused: {expected}" if expected else "sent and verified")
    try:
        url = validate_destination(raw, allow_http=True, allowed_cidrs=PRODUCER.allowed_cidrs)
    except OutboxValidationError as exc:
        assert exc.field == "url"
        assert expected is not None, f"refused an ordinary URL: {exc}"
        return
    assert expected is None, f"accepted a URL with a {expected}"
    assert url.isascii() and canonicalize_url(url) == url  # one canonical form, stable
    status, kind, arrived = deliver(harness, url)
    assert (status, kind) == (200, None), f"receiver answered {status}/{kind} for {url!r}"
    assert arrived == url  # the request target on the wire is the signed @target-uri, byte for byte


@pytest.mark.parametrize(
    ("raw_tail", "canonical_tail"),
    [
        ("/caf\u00e9?q=\u00fc", "/caf%C3%A9?q=%C3%BC"),
        ("/a+b?x=1&x=2", "/a+b?x=1&x=2"),
        ("/a%2fb/~u", "/a%2Fb/~u"),
        ("/%7E%41", "/~A"),
        ("/a/./b/../c", "/a/c"),
        ("/{x}?q=[1]", "/%7Bx%7D?q=%5B1%5D"),
    ],
)
def test_ordinary_urls_are_stored_canonical(raw_tail: str, canonical_tail: str) -> None:
    base = "https://Buyer.Example:443"
    assert validate_destination(base + raw_tail) == "https://buyer.example" + canonical_tail


@pytest.mark.parametrize(
    ("raw_tail", "why"),
    [
        ("/a%zz", "does not start a %XX escape"),
        ("/a/%2e%2E/b", "dot segment spelled with %2E"),
        ("/a\\b", "backslash"),
        ("/\ud800", "not valid Unicode"),
        ("/" + "\u00e9" * 400, "once percent-encoded"),
    ],
)
def test_unsendable_urls_are_refused_naming_url(raw_tail: str, why: str) -> None:
    with pytest.raises(OutboxValidationError, match=why) as caught:
        validate_destination("https://buyer.example" + raw_tail)
    assert caught.value.field == "url"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("https://[v1.fe]/h", "not an IPv6 address"),  # IPvFuture: without its brackets, a DNS name
        ("https://[v7.buyer.example]/h", "not an IPv6 address"),
        ("https://buyer.example:0/h", "port is not a number in 1..65535"),
        ("https://buyer.example:65536/h", "port is not a number in 1..65535"),
        ("https://127.1/h", "non-standard form"),  # every one of these reaches 127.0.0.1
        ("https://2130706433/h", "non-standard form"),
        ("https://0x7f000001/h", "non-standard form"),
        ("https://0177.0.0.1/h", "non-standard form"),
        ("https://127.1./h", "non-standard form"),
    ],
)
def test_hosts_and_ports_that_name_another_destination_are_refused(url: str, why: str) -> None:
    """Refused when stored, and by the daemon for a row written by plain SQL (no canonical form)."""
    with pytest.raises(OutboxValidationError, match=re.escape(why)) as caught:
        validate_destination(url)
    assert caught.value.field == "url"
    assert endpoint_origin(url) is None


def test_zone_identifier_is_refused() -> None:
    with pytest.raises(OutboxValidationError, match="zone identifier") as caught:
        validate_destination("https://[fe80::1%25eth0]/", allowed_cidrs=[ipaddress.ip_network("fe80::/10")])
    assert caught.value.field == "url"


@pytest.mark.parametrize("tail", ["/a/%7e", "/a/../b", "/{x}", "/p?"])
def test_sender_refuses_a_target_other_than_the_signed_one(harness: Harness, tail: str) -> None:
    """A row whose URL bypassed enqueue: httpx would send another target than the signed one."""
    url = f"http://127.0.0.1:{harness.port}{PREFIX}{tail}"
    status, kind, arrived = deliver(harness, url)
    assert (status, kind, arrived) == (None, "invalid", None)  # nothing reached the buyer
    verdict = classify_transport_error("invalid")
    assert (verdict.action, verdict.reason) == ("dead", "invalid")
