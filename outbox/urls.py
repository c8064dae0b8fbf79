"""Webhook destination URLs: validation, canonical form, and the address block list.

One module owns these rules because three places need them identically: enqueue (refuse a
bad registration before anything is stored), signing (``@target-uri`` and ``@authority``
must describe the URL actually POSTed, docs/protocol.md "Signing") and the daemon's send-time
SSRF check (docs/protocol.md "Destinations (SSRF)"), which re-applies :func:`blocked_reason` to every resolved address.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Iterable
from urllib.parse import urlsplit, urlunsplit

import idna

from outbox.errors import OutboxValidationError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_URL_LENGTH = 2048
_DEFAULT_PORTS = {"https": 443, "http": 80}
_PERCENT = re.compile(r"%[0-9a-fA-F]{2}")
_BAD_CHARS = re.compile(r"[\s\x00-\x1f\x7f]")
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


def _canonical_host(host: str) -> str:
    host = host.rstrip(".") if host.endswith(".") and not host.endswith("..") else host
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    lowered = host.lower()
    if _ASCII_HOST.fullmatch(lowered):  # the common case: UTS-46 would return it unchanged
        return lowered
    try:
        return idna.encode(host, uts46=True).decode("ascii").lower()
    except idna.IDNAError as exc:
        raise OutboxValidationError("url", f"host {host!r} is not a valid domain name ({exc})") from None


def canonicalize_url(url: str) -> str:
    """The AdCP canonical form of a webhook URL (docs/protocol.md "Signing" ``@target-uri``).

    Lowercase scheme and host, UTS-46 IDN, default port and one trailing dot stripped,
    percent-escapes uppercased, an empty path made ``/``, the query kept byte for byte.
    The daemon POSTs to exactly this string, so the signature describes the real request.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = _canonical_host(parts.hostname or "")
    try:
        port = parts.port
    except ValueError:
        raise OutboxValidationError("url", "port is not a number in 1..65535") from None
    netloc = f"[{host}]" if ":" in host else host
    if port is not None and port != _DEFAULT_PORTS.get(scheme):
        netloc = f"{netloc}:{port}"
    path = _PERCENT.sub(lambda m: m.group(0).upper(), parts.path) or "/"
    return urlunsplit((scheme, netloc, path, parts.query, ""))


def authority(canonical_url: str) -> str:
    """``@authority`` of a canonical URL: lowercase ``host[:port]``, default port stripped."""
    return urlsplit(canonical_url).netloc


def origin(canonical_url: str) -> str:
    """``scheme://authority``: the circuit-breaker and connection-pool key of an endpoint."""
    parts = urlsplit(canonical_url)
    return f"{parts.scheme}://{parts.netloc}"


def without_query(url: str) -> str:
    """The URL fit for logs and the activity record: no query, no fragment (docs/protocol.md "Attempt records")."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


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
    if len(url) > MAX_URL_LENGTH:
        raise OutboxValidationError("url", f"longer than {MAX_URL_LENGTH} characters")
    if _BAD_CHARS.search(url):
        raise OutboxValidationError("url", "contains whitespace or control characters")
    path_and_query = url.split("://", 1)[-1].partition("/")[2]
    if not path_and_query.isascii():
        # An RFC 9421 signature base is ASCII: percent-encode path and query (IDN hosts are fine).
        raise OutboxValidationError("url", "path or query has non-ASCII characters: percent-encode them")
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
