"""SSRF rules (docs/protocol.md "Destinations (SSRF)"), one test per rule: the address block list, the
operator's exemption, and the send-time check that turns a blocked destination into a
dead message whose error says nothing about the resolver."""

from __future__ import annotations

import hashlib
import ipaddress
import json

import pytest

import outbox
from outbox.errors import OutboxValidationError
from outbox.leases import Claimed
from outbox.urls import blocked_reason, validate_destination
from supervisor.cycle.attempt import attempt
from outbox.db import make_async_engine
from supervisor.keys.keyring_cache import CachedKeyring
from supervisor.wire.signing import generate_signing_key_pem
from supervisor.wire.transport import HttpSender

BLOCKED = [
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"),
    ("127.0.0.1", "loopback"), ("::1", "loopback"),
    ("169.254.10.10", "link-local"), ("fe80::1", "link-local"),
    ("100.64.0.1", "carrier-grade NAT"),
    ("224.0.0.1", "multicast"), ("ff02::1", "multicast"),
    ("240.0.0.1", "reserved"), ("255.255.255.255", "reserved"), ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("fc00::1", "unique local"), ("fd12:3456::1", "unique local"),
    ("169.254.169.254", "cloud metadata"), ("fd00:ec2::254", "cloud metadata"),
    ("100.100.100.200", "cloud metadata"), ("192.0.0.192", "cloud metadata"),
    ("::ffff:10.0.0.1", "private (IPv4 embedded in IPv6)"),          # IPv4-mapped
    ("::ffff:127.0.0.1", "loopback (IPv4 embedded in IPv6)"),
    ("64:ff9b::a9fe:a9fe", "cloud metadata (IPv4 embedded in IPv6)"),  # NAT64 of 169.254.169.254
    ("64:ff9b::c0a8:0101", "private (IPv4 embedded in IPv6)"),         # NAT64 of 192.168.1.1
    ("2002:0a00:0001::1", "private (IPv4 embedded in IPv6)"),          # 6to4 of 10.0.0.1
    ("::10.0.0.1", "private (IPv4 embedded in IPv6)"),                 # IPv4-compatible
    ("64:ff9b:1::1", "local-use NAT64"),
    ("198.18.0.1", "benchmarking"), ("192.0.2.1", "documentation"), ("2001:db8::1", "documentation"),
]


@pytest.mark.parametrize(("address", "reason"), BLOCKED, ids=[a for a, _ in BLOCKED])
def test_blocked_ranges(address, reason):
    assert blocked_reason(ipaddress.ip_address(address)) == reason


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8",
                                     "64:ff9b::808:808"])
def test_public_addresses_pass(address):
    assert blocked_reason(ipaddress.ip_address(address)) is None


def test_allowed_cidrs_open_a_private_network_but_never_metadata():
    allowed = [ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("169.254.0.0/16"),
               ipaddress.ip_network("fd00::/8")]
    assert blocked_reason(ipaddress.ip_address("10.9.9.9"), allowed) is None
    assert blocked_reason(ipaddress.ip_address("::ffff:10.9.9.9"), allowed) is None
    assert blocked_reason(ipaddress.ip_address("169.254.169.254"), allowed) == "cloud metadata"
    assert blocked_reason(ipaddress.ip_address("fd00:ec2::254"), allowed) == "cloud metadata"
    assert blocked_reason(ipaddress.ip_address("192.168.1.1"), allowed) == "private"


def test_a_url_checked_under_one_policy_is_judged_again_under_another():
    """Checks are remembered per URL and policy: an address allowed once, or plain HTTP
    allowed once, is refused when the same URL comes under a stricter policy, every time."""
    allowed = [ipaddress.ip_network("10.0.0.0/8")]
    for _ in range(2):
        assert validate_destination("https://10.1.2.3/hook", allowed_cidrs=allowed) == "https://10.1.2.3/hook"
        with pytest.raises(OutboxValidationError, match="private"):
            validate_destination("https://10.1.2.3/hook")
        assert validate_destination("http://buyer.example/hook", allow_http=True) == "http://buyer.example/hook"
        with pytest.raises(OutboxValidationError, match="https"):
            validate_destination("http://buyer.example/hook")


async def _keyring(settings: outbox.Settings, database_url: str) -> CachedKeyring:
    """The daemon's keyring, seeded from the configured key file."""
    engine = make_async_engine(database_url)
    keys = CachedKeyring(settings)
    try:
        await keys.start(engine)
    finally:
        await engine.dispose()
    return keys


def _claimed(url: str) -> Claimed:
    key = "whk_ssrf_test_key_000000001"
    body = json.dumps({"idempotency_key": key, "task_id": "t"}).encode()
    return Claimed(id=1, tenant_id="t", url=url, origin=None, idempotency_key=key, body=body,
                   body_sha256=hashlib.sha256(body).digest(), auth_mode="rfc9421", auth_secret=None,
                   sequence_number=None, notification_type=None, attempt=1, retry_until=2e9, created_at=1e9,
                   trigger="scheduled", claimed_at=1.7e9, lease_token="x")


@pytest.mark.parametrize("resolved", ["10.0.0.7", "127.0.0.1", "169.254.169.254", "::ffff:192.168.0.1",
                                      "fe80::1"])
async def test_a_host_resolving_to_a_blocked_address_is_dead_blocked(tmp_path, sqlite_url, resolved):
    """Send time ("Destinations (SSRF)"): resolve, vet every answer, never connect; the error is generic."""
    pem = tmp_path / "k.pem"
    pem.write_bytes(generate_signing_key_pem())
    settings = outbox.load_settings(env={}, signing_key_file=str(pem), signing_key_id="k")
    lookups = []

    async def resolver(host: str, port: int) -> list[str]:
        lookups.append(host)
        return ["93.184.216.34", resolved]  # one bad answer blocks the host (rebinding-safe)

    sender = HttpSender(settings, resolver=resolver)
    try:
        outcome = await attempt(_claimed("https://buyer.example.com/hook?token=s3cret"), settings=settings,
                                keys=await _keyring(settings, sqlite_url), sender=sender)
    finally:
        await sender.aclose()
    assert (outcome.action, outcome.reason, outcome.sent) == ("dead", "blocked", False)
    assert lookups == ["buyer.example.com"]
    assert outcome.error.startswith("destination address is not allowed")
    for leak in (resolved, "93.184.216.34", "s3cret", "buyer.example.com"):
        assert leak not in outcome.error


async def test_http_is_blocked_unless_allowed(tmp_path, sqlite_url):
    pem = tmp_path / "k.pem"
    pem.write_bytes(generate_signing_key_pem())
    strict = outbox.load_settings(env={}, signing_key_file=str(pem), signing_key_id="k")
    sender = HttpSender(strict)
    try:
        outcome = await attempt(_claimed("http://buyer.example.com/hook"), settings=strict,
                                keys=await _keyring(strict, sqlite_url), sender=sender)
    finally:
        await sender.aclose()
    # Caught by the row's integrity check (same rules as enqueue) before any lookup.
    assert (outcome.action, outcome.reason) == ("dead", "invalid") and "https" in outcome.error
