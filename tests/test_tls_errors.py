"""TLS failures name their cause: real certificates made here, served by real TLS receivers
on 127.0.0.1, each wrong in one way. The cause reaches the attempt's error and the
message's ``last_error`` (end to end through ``outboxd run``), and never the host, the
address or the URL."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from sqlalchemy import select

from outbox.config import load_settings
from outbox.schema import attempts, messages
from supervisor.wire.transport import HttpSender

from tests.ledger import enqueue_batch, message_key

NOW = datetime.datetime.now(datetime.timezone.utc)
DAY = datetime.timedelta(days=1)
SECRET = "tok3nSECRET"


@dataclass(frozen=True)
class Authority:
    """A certificate authority made for one test run."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def make(cls, name: str) -> Authority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(NOW - DAY).not_valid_after(NOW + DAY)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(key, cert)

    def issue(self, directory: Path, name: str, *, dns: str = "buyer.example", ip: str | None = "127.0.0.1",
              valid: tuple[datetime.datetime, datetime.datetime] = (NOW - DAY, NOW + DAY)) -> ssl.SSLContext:
        """A server context serving a leaf certificate for ``dns`` (and ``ip``) valid over ``valid``."""
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = [x509.DNSName(dns)]
        if ip is not None:
            names.append(x509.IPAddress(ipaddress.ip_address(ip)))
        cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns)]))
                .issuer_name(self.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(valid[0]).not_valid_after(valid[1])
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .sign(self.key, hashes.SHA256()))
        chain, key_file = directory / f"{name}.pem", directory / f"{name}-key.pem"
        chain.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(chain, key_file)
        return context


def no_shared_cipher(context: ssl.SSLContext) -> ssl.SSLContext:
    """TLS 1.2 with only a CBC-SHA1 suite, which a default client never offers."""
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers("ECDHE-ECDSA-AES128-SHA")
    return context


Case = Callable[[Authority, Authority, Path], ssl.SSLContext]
CASES: dict[str, tuple[Case, str, str]] = {  # server context; error for https://127.0.0.1, for https://buyer.example
    "good": (lambda ca, _, d: ca.issue(d, "good"), "", ""),
    "other-name": (lambda ca, _, d: ca.issue(d, "other", dns="other.example", ip=None),
                   "ConnectError: TLS certificate name mismatch (not valid for this address)",
                   "ConnectError: TLS certificate name mismatch (not valid for this host)"),
    "expired": (lambda ca, _, d: ca.issue(d, "expired", valid=(NOW - 3 * DAY, NOW - DAY)),
                "ConnectError: TLS certificate expired", "ConnectError: TLS certificate expired"),
    "not-yet-valid": (lambda ca, _, d: ca.issue(d, "early", valid=(NOW + DAY, NOW + 3 * DAY)),
                      "ConnectError: TLS certificate not yet valid", "ConnectError: TLS certificate not yet valid"),
    "unknown-authority": (lambda _, other, d: other.issue(d, "stranger"),
                          "ConnectError: TLS certificate from an unknown authority",
                          "ConnectError: TLS certificate from an unknown authority"),
    "handshake": (lambda ca, _, d: no_shared_cipher(ca.issue(d, "old")),
                  "ConnectError: TLS handshake failed (SSLV3_ALERT_HANDSHAKE_FAILURE)",
                  "ConnectError: TLS handshake failed (SSLV3_ALERT_HANDSHAKE_FAILURE)"),
}


def _serve(listener: socket.socket, context: ssl.SSLContext) -> None:
    """A blocking TLS receiver, as common servers behave: a failed handshake ends with its
    alert and a clean close; a request gets a 200."""
    while True:
        try:
            raw, _ = listener.accept()
        except OSError:
            return  # closed: the test is over
        with raw:
            raw.settimeout(10)
            try:
                with context.wrap_socket(raw, server_side=True) as conn:
                    head = b""
                    while b"\r\n\r\n" not in head:
                        head += conn.recv(65536) or b"\r\n\r\n"
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            except (OSError, ssl.SSLError):
                pass  # the handshake failed: what the sender saw is under test


@pytest.fixture
def receivers(tmp_path: Path) -> Iterator[tuple[Path, dict[str, int]]]:
    """One TLS receiver per case (each its own origin); yields the trusted CA file and the ports."""
    trusted, stranger = Authority.make("outboxd test CA"), Authority.make("someone else's CA")
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(trusted.cert.public_bytes(serialization.Encoding.PEM))
    listeners = {name: socket.create_server(("127.0.0.1", 0)) for name in CASES}
    for name, (make, _, _) in CASES.items():
        threading.Thread(target=_serve, args=(listeners[name], make(trusted, stranger, tmp_path)), daemon=True).start()
    yield ca_file, {name: listener.getsockname()[1] for name, listener in listeners.items()}
    for listener in listeners.values():
        listener.shutdown(socket.SHUT_RDWR)  # wakes its thread's accept
        listener.close()


async def _resolve_to_loopback(host: str, port: int) -> list[str]:
    return ["127.0.0.1"]


@pytest.mark.parametrize("host", ["127.0.0.1", "buyer.example"])
async def test_each_tls_failure_names_its_cause_and_nothing_else(receivers, host: str) -> None:
    ca_file, ports = receivers
    settings = load_settings(env={"OUTBOX_ALLOWED_CIDRS": "127.0.0.0/8", "OUTBOX_TLS_CA_FILE": str(ca_file)})
    sender = HttpSender(settings, resolver=_resolve_to_loopback)
    try:
        for name, (_, by_address, by_name) in CASES.items():
            result = await sender.post(f"https://{host}:{ports[name]}/hook?token={SECRET}", b"{}", {})
            expected = by_address if host == "127.0.0.1" else by_name
            assert (result.status, result.error or "") == ((200 if name == "good" else None), expected), name
            if result.error:
                assert result.error_kind == "connection_error"
                for secret in (SECRET, host, str(ports[name]), "other.example"):
                    assert secret not in result.error
    finally:
        await sender.aclose()


async def test_a_receiver_that_drops_the_handshake_fails_the_handshake() -> None:
    """A peer that closes as the ClientHello arrives (a TLS-terminating proxy refusing us)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def drop() -> None:
        conn, _ = listener.accept()
        conn.recv(1)
        conn.close()  # the rest of the ClientHello unread: the kernel resets the connection

    threading.Thread(target=drop, daemon=True).start()
    sender = HttpSender(load_settings(env={"OUTBOX_ALLOWED_CIDRS": "127.0.0.0/8"}))
    try:
        result = await sender.post(f"https://127.0.0.1:{listener.getsockname()[1]}/hook", b"{}", {})
    finally:
        await sender.aclose()
        listener.close()
    assert (result.error_kind, result.error) == ("connection_error",
                                                 "ConnectError: TLS handshake failed (connection reset by peer)")


@pytest.mark.e2e
def test_the_cause_reaches_the_attempt_and_the_message(receivers, pg_engine, pg_url, tmp_path: Path) -> None:
    from tests import procs

    ca_file, ports = receivers
    key, _ = procs.make_key(tmp_path)
    keys = {name: message_key(f"tls{n}", 0) for n, name in enumerate(CASES)}
    enqueue_batch(pg_engine, [("t1", f"https://127.0.0.1:{ports[name]}/hook?token={SECRET}", keys[name])
                              for name in CASES])
    daemon = procs.start_daemon(procs.daemon_env(pg_url, key, tls_ca_file=ca_file,
                                                retry_base_seconds=30, retry_max_seconds=60),
                                tmp_path / "d.log")

    def first_attempts() -> dict[str, str | None]:
        with pg_engine.connect() as conn:
            return dict(conn.execute(select(attempts.c.idempotency_key, attempts.c.error)
                                     .where(attempts.c.attempt_number == 1)).all())

    try:
        assert procs.wait_until(lambda: len(first_attempts()) == len(CASES) or daemon.poll() is not None, 60)
    finally:
        assert procs.stop(daemon) == 0
    recorded = first_attempts()
    with pg_engine.connect() as conn:
        last = dict(conn.execute(select(messages.c.idempotency_key, messages.c.last_error)).all())
    for name, (_, by_address, _) in CASES.items():
        assert recorded[keys[name]] == (by_address or None), name
        assert last[keys[name]] == (by_address or None), name
