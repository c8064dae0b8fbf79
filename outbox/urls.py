"""Webhook destination URLs: validation, canonical form, and the address block list.

One module owns these rules because three places need them identically: enqueue (refuse a
bad registration before anything is stored), signing (``@target-uri`` and ``@authority``
must describe the URL actually POSTed, docs/protocol.md "Signing") and the daemon's send-time
SSRF check (docs/protocol.md "Destinations (SSRF)"), which re-applies :func:`blocked_reason` to every resolved address.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import string
from typing import Iterable
from urllib.parse import urlsplit, urlunsplit

import idna

from outbox.errors import OutboxValidationError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_URL_LENGTH = 2048
_DEFAULT_PORTS = {"https": 443, "http": 80}
_STRAY_PERCENT = re.compile(r"%(?![0-9a-fA-F]{2})")
_ESCAPED_DOT = re.compile(r"%2[eE]")
_BAD_CHARS = re.compile(r"[\s\x00-\x1f\x7f]")
# RFC 3986 §2.3 unreserved, §3.3 pchar, §3.4 query: what a canonical path or query may hold
# unescaped. Everything else (non-ASCII included) is percent-encoded as UTF-8.
_UNRESERVED = frozenset(string.ascii_letters + string.digits + "-._~")
_PATH_SAFE = _UNRESERVED | frozenset("!$&'()*+,;=:@/")
# A WHATWG URL parser (the TypeScript verifier re-parses what arrives) percent-encodes "'" in
# the query of an http(s) URL: sent as it is, the verifier would rebuild another string.
_QUERY_SAFE = (_PATH_SAFE - frozenset("'")) | frozenset("?")
# Plain LDH labels (letters, digits, inner hyphens; no "xn--" punycode to re-check): UTS-46
# leaves such a host as it is, so it needs no IDNA processing (the slow part of enqueue).
_ASCII_HOST = re.compile(r"(?!.*(?:^|\.)xn--)(?:(?!-)[a-z0-9-]{1,63}(?<!-)\.)*(?!-)[a-z0-9-]{1,63}(?<!-)")

# docs/protocol.md "Destinations (SSRF)": every range the spec and the SDK block, plus the ones Python's
# ``ipaddress`` flags. Cloud metadata endpoints stay blocked even inside an allowed CIDR.
_BLOCKED_NETWORKS: tuple[tuple[Network, str], ...] = tuple(
    (ipaddress.ip_network(net), why)
    for net, why in (
        ("0.0.0.0/8", "unspecified"),
        ("10.0.0.0/8", "private"),
        ("100.64.0.0/10", "carrier-grade NAT"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local"),
        ("172.16.0.0/12", "private"),
        ("192.0.0.0/24", "IETF protocol assignments"),
        ("192.0.2.0/24", "documentation"),
        ("192.31.196.0/24", "AS112"),
        ("192.52.193.0/24", "AMT"),
        ("192.88.99.0/24", "6to4 relay anycast"),
        ("192.168.0.0/16", "private"),
        ("192.175.48.0/24", "AS112"),
        ("198.18.0.0/15", "benchmarking"),
        ("198.51.100.0/24", "documentation"),
        ("203.0.113.0/24", "documentation"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved"),
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("64:ff9b:1::/48", "local-use NAT64"),
        ("100::/64", "discard-only"),
        ("2001::/23", "IETF protocol assignments"),
        ("2001:db8::/32", "documentation"),
        ("2002::/16", "6to4"),
        ("fc00::/7", "unique local"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "site-local"),
        ("ff00::/8", "multicast"),
    )
)
_METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200", "192.0.0.192")
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form smuggles: mapped, compatible, NAT64 or 6to4."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return address.sixtofour
    packed = int(address)
    if packed >> 32 == 0 and packed > 1:  # deprecated IPv4-compatible ::a.b.c.d
        return ipaddress.IPv4Address(packed)
    return None


def blocked_reason(address: IPAddress, allowed: Iterable[Network] = ()) -> str | None:
    """Why a webhook may not connect to ``address``, or ``None`` when it may.

    ``allowed`` (``OUTBOX_ALLOWED_CIDRS``) is the only way into a private network; it never
    opens a cloud metadata address. IPv6 forms that embed an IPv4 address are judged by the
    IPv4 address they reach.
    """
    allowed = tuple(allowed)
    if isinstance(address, ipaddress.IPv6Address):
        inner = _embedded_ipv4(address)
        if inner is not None:
            reason = blocked_reason(inner, allowed)
            return reason and f"{reason} (IPv4 embedded in IPv6)"
    if address in _METADATA_ADDRESSES:
        return "cloud metadata"
    if any(address.version == n.version and address in n for n in allowed):
        return None
    for network, why in _BLOCKED_NETWORKS:
        if address.version == network.version and address in network:
            return why
    if address.is_private or address.is_reserved or address.is_multicast or address.is_link_local:
        return "reserved"
    if address.is_loopback or address.is_unspecified:
        return "loopback"
    return None


_NUMERIC_LABEL = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]*")


def _canonical_host(host: str) -> str:
    if "%" in host:
        raise OutboxValidationError("url", "host must not contain '%' (an IPv6 zone identifier is node-local)")
    host = host.rstrip(".") if host.endswith(".") and not host.endswith("..") else host
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    if _NUMERIC_LABEL.fullmatch(host.rpartition(".")[2]):
        # 127.1, 2130706433, 0x7f000001, 0177.0.0.1: resolvers (and WHATWG URL parsers) read
        # a host ending in a number as an IPv4 address, so it must pass the address checks.
        raise OutboxValidationError("url", f"host {host!r} is an IPv4 address in a non-standard form: write it "
                                           "as four decimal numbers (a.b.c.d)")
    lowered = host.lower()
    if _ASCII_HOST.fullmatch(lowered):  # the common case: UTS-46 would return it unchanged
        return lowered
    try:
        return idna.encode(host, uts46=True).decode("ascii").lower()
    except idna.IDNAError as exc:
        raise OutboxValidationError("url", f"host {host!r} is not a valid domain name ({exc})") from None


def _escape(char: str) -> str:
    try:
        return "".join(f"%{b:02X}" for b in char.encode("utf-8"))
    except UnicodeEncodeError:
        raise OutboxValidationError("url", "is not valid Unicode (lone surrogate)") from None


def _normalize_escapes(text: str, safe: frozenset[str], *, normalize: bool = True) -> str:
    """``text`` with every character outside ``safe`` percent-encoded as UTF-8, and its
    existing escapes normalized as the AdCP verifiers do (RFC 3986 §6.2.2.2): hex uppercased,
    escaped unreserved characters decoded. In the path and in the query alike: the
    TypeScript verifier normalizes the whole URL it rebuilds ``@target-uri`` from, and the
    Python one rebuilds it from what arrives, so only a normalized spelling verifies with both.
    ``normalize=False`` keeps the escapes as written (:func:`earlier_spelling`).
    """
    if _STRAY_PERCENT.search(text):
        raise OutboxValidationError("url", "has a '%' that does not start a %XX escape: write it as %25")
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == "%":
            escape = text[i : i + 3]
            decoded = chr(int(escape[1:], 16))
            out.append((decoded if decoded in _UNRESERVED else escape.upper()) if normalize else escape)
            i += 3
            continue
        out.append(char if char in safe else _escape(char))
        i += 1
    return "".join(out)


def _remove_dot_segments(path: str) -> str:
    """RFC 3986 §5.2.4 for an absolute path: what ``.`` and ``..`` segments mean."""
    output: list[str] = []
    segments = path.split("/")[1:]
    for index, segment in enumerate(segments):
        last = index == len(segments) - 1
        if segment == "..":
            if len(output) > 0:
                output.pop()
        elif segment != ".":
            output.append(segment)
            continue
        if last:
            output.append("")  # "/a/.." and "/a/." end in a slash
    return "/" + "/".join(output)


def _canonical_path(path: str) -> str:
    for segment in path.split("/"):
        if "%" in segment and _ESCAPED_DOT.sub(".", segment) in (".", ".."):
            # The verifier removes literal dot segments before it decodes %2E, so no
            # spelling of this path can be both sent and verified; servers disagree on it too.
            raise OutboxValidationError("url", "has a dot segment spelled with %2E: write the path without it")
    return _remove_dot_segments(_normalize_escapes(path, _PATH_SAFE)) if path else "/"


@functools.lru_cache(maxsize=4096)  # pure; the daemon asks it of the same buyer URLs on every attempt
def canonicalize_url(url: str) -> str:
    """The AdCP canonical form of a webhook URL (docs/protocol.md "Signing" ``@target-uri``), also what is sent.

    Lowercase scheme and host, UTS-46 IDN, default port and one trailing dot stripped. The
    path and the query are normalized the way the AdCP verifiers normalize what arrives
    (percent-escapes uppercased, escaped unreserved characters decoded; in the path, dot
    segments removed and an empty path made ``/``). Characters that are not legal in a URI
    (non-ASCII, ``"<>[]^`{|}``), and ``'`` in the query, are percent-encoded as UTF-8, as
    RFC 3987 §3.1 maps an IRI to a URI and a WHATWG parser encodes a query, so httpx has
    nothing left to escape. The result is a fixed point of both the
    verifier's canonicalization and httpx's URL encoding: the daemon POSTs exactly this
    string and the receiver rebuilds exactly it (see docs/enqueue.md, "URL rules").
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = _canonical_host(parts.hostname or "")
    if "[" in parts.netloc and ":" not in host:
        # An IP literal in brackets is IPv6 (RFC 3986 §3.2.2); IPvFuture and IPv4 in brackets
        # would otherwise lose the brackets and name another host.
        raise OutboxValidationError("url", f"host [{parts.hostname}] is not an IPv6 address")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise OutboxValidationError("url", "port is not a number in 1..65535")
    netloc = f"[{host}]" if ":" in host else host
    if port is not None and port != _DEFAULT_PORTS.get(scheme):
        netloc = f"{netloc}:{port}"
    path = _canonical_path(parts.path)
    query = _normalize_escapes(parts.query, _QUERY_SAFE)
    return urlunsplit((scheme, netloc, path, query, ""))


def earlier_spelling(url: str) -> str:
    """``url`` as releases up to 0.2.0 canonicalized it: as :func:`canonicalize_url` does, but
    the query's escapes kept as written and ``'`` left as it is. Those releases numbered a
    delivery report's default stream under this spelling (tenant + media buy + URL), so a
    stream to such a URL continues from there (``outbox.producer``); for most URLs it is the
    canonical spelling itself."""
    canonical = urlsplit(canonicalize_url(url))
    earlier = _normalize_escapes(urlsplit(url).query, _QUERY_SAFE | frozenset("'"), normalize=False)
    return urlunsplit(canonical._replace(query=earlier))


def authority(canonical_url: str) -> str:
    """``@authority`` of a canonical URL: lowercase ``host[:port]``, default port stripped."""
    return urlsplit(canonical_url).netloc


def origin(canonical_url: str) -> str:
    """``scheme://authority``: the circuit-breaker and connection-pool key of an endpoint."""
    parts = urlsplit(canonical_url)
    return f"{parts.scheme}://{parts.netloc}"


@functools.lru_cache(maxsize=4096)  # pure, and asked of every claimed row
def endpoint_origin(url: str) -> str | None:
    """:func:`origin` of any stored URL, canonicalized first; ``None`` if it has no canonical form.

    The daemon applies it to every claimed row, so a row's origin is this function's result
    whichever way the row was written (producer, plain-SQL trigger, or neither).
    """
    try:  # only scheme and authority decide it: a path the sender would refuse changes nothing
        parts = urlsplit(url)
        return origin(canonicalize_url(urlunsplit((parts.scheme, parts.netloc, "/", "", ""))))
    except ValueError:  # OutboxValidationError, or urlsplit's own "Invalid IPv6 URL"
        return None


def public_url(url: str) -> str:
    """The URL fit for output: no userinfo, no query, no fragment, where buyers put secrets
    (docs/protocol.md "Attempt records")."""
    scheme, separator, rest = url.partition("://")
    rest = _QUERY_OR_FRAGMENT.split(rest if separator else url, maxsplit=1)[0]
    if not separator:
        return rest
    authority, slash, path = rest.partition("/")
    return f"{scheme}://{authority.rpartition('@')[2]}{slash}{path}"


_QUERY_OR_FRAGMENT = re.compile(r"[?#]")
# A URL inside free text (a stream key, an error): its scheme, then everything up to a delimiter.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]*")


def redact_urls(text: str) -> str:
    """``text`` with every URL in it reduced to :func:`public_url`'s form (CLI output, logs).

    :func:`public_url` removes only userinfo (after ``@``), the query (``?``) and the fragment
    (``#``): a text with none of the three is returned as it is without being searched, which
    is every attempt's log line (its URL is already public), at a third of the cost."""
    if "://" not in text or not ("@" in text or "?" in text or "#" in text):
        return text
    return _URL_IN_TEXT.sub(lambda match: public_url(match.group(0)), text)


def validate_destination(
    url: object,
    *,
    allow_http: bool = False,
    allowed_cidrs: Iterable[Network] = (),
) -> str:
    """Check a buyer-supplied webhook URL before it is stored; return its canonical form.

    Registration-time half of docs/protocol.md "Destinations (SSRF)": absolute ``https`` (``http`` only when
    the operator allows it), no userinfo, no fragment, and no IP-literal host in a blocked
    range. Host names are resolved and re-checked by the daemon at send time.
    """
    if not isinstance(url, str) or not url:
        raise OutboxValidationError("url", "must be a non-empty string")
    return _validated(url, allow_http, tuple(allowed_cidrs))


@functools.lru_cache(maxsize=4096)
def _validated(url: str, allow_http: bool, allowed_cidrs: tuple[Network, ...]) -> str:
    """:func:`validate_destination` of a string, remembered per (URL, policy): a seller's
    buyers register a handful of URLs, and enqueue and every attempt check them again (a
    rejection is an exception, never remembered)."""
    if len(url) > MAX_URL_LENGTH:
        raise OutboxValidationError("url", f"longer than {MAX_URL_LENGTH} characters")
    if _BAD_CHARS.search(url):
        raise OutboxValidationError("url", "contains whitespace or control characters")
    if "\\" in url:
        # WHATWG URL parsers read a backslash as "/", RFC 3986 ones as data: no one form means both.
        raise OutboxValidationError("url", "contains a backslash: write '/' or %5C")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise OutboxValidationError("url", f"is not a valid URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in ("https", "http") or not parts.netloc:
        raise OutboxValidationError("url", "must be an absolute https:// URL")
    if scheme == "http" and not allow_http:
        raise OutboxValidationError("url", "must use https (set OUTBOX_ALLOW_HTTP=true for local testing only)")
    if "@" in parts.netloc:
        raise OutboxValidationError("url", "must not carry userinfo (credentials belong in authentication)")
    if parts.fragment or url.endswith("#"):
        raise OutboxValidationError("url", "must not have a fragment")
    if not parts.hostname:
        raise OutboxValidationError("url", "has no host")
    canonical = canonicalize_url(url)
    if len(canonical) > MAX_URL_LENGTH:
        raise OutboxValidationError("url", f"longer than {MAX_URL_LENGTH} characters once percent-encoded")
    host = urlsplit(canonical).hostname or ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return canonical
    reason = blocked_reason(address, allowed_cidrs)
    if reason is not None:
        raise OutboxValidationError(
            "url", f"host {host} is a {reason} address (add its network to OUTBOX_ALLOWED_CIDRS to allow it)"
        )
    return canonical
