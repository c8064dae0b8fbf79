"""HTTPS trust as operators configure it (supervisor/wire/tls.py): a private CA by file or
directory, SSL_CERT_FILE / SSL_CERT_DIR, the system store via truststore, certifi by default.
Each case POSTs to a real TLS receiver on 127.0.0.1 whose certificate a throwaway CA signed."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import ssl
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from outbox.config import load_settings
from outbox.errors import ConfigurationError
from outboxd_bench.certs import make_tls_files
from outboxd_receiver import Receiver, serve
from supervisor.wire.tls import tls_context
from supervisor.wire.transport import HttpSender

BODY = b'{"idempotency_key": "whk_tls_case_0001"}'


@pytest.fixture
def ca(tmp_path: Path) -> tuple[Path, Path, Path]:
    return make_tls_files(tmp_path)


@pytest.fixture
async def https_url(ca: tuple[Path, Path, Path]) -> AsyncIterator[str]:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(ca[1], ca[2])
    server = await serve(Receiver(None, None, scheme="https"), 0, server_ctx)
    yield f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/ok"
    server.close()


def _settings(**env: str):  # type: ignore[no-untyped-def]
    return load_settings(env={"OUTBOX_ALLOWED_CIDRS": "127.0.0.0/8", **env})


async def _post(settings, url: str,  # type: ignore[no-untyped-def]
                env: dict[str, str] | None = None) -> tuple[int | None, str | None]:
    sender = HttpSender(settings, verify=tls_context(settings, env or {}))
    try:
        result = await sender.post(url, BODY, {"Content-Type": "application/json"})
    finally:
        await sender.aclose()
    return result.status, result.error


async def test_default_certifi_refuses_a_private_ca(https_url: str) -> None:
    assert await _post(_settings(), https_url) == (None, "ConnectError: TLS certificate from an unknown authority")


async def test_ca_file_setting_trusts_the_private_ca(https_url: str, ca: tuple[Path, Path, Path]) -> None:
    assert await _post(_settings(OUTBOX_TLS_CA_FILE=str(ca[0])), https_url) == (200, None)
    # the same CA through the daemon's own construction (no verify override)
    sender = HttpSender(_settings(OUTBOX_TLS_CA_FILE=str(ca[0])))
    try:
        assert (await sender.post(https_url, BODY, {})).status == 200
    finally:
        await sender.aclose()


async def test_ssl_cert_file_replaces_certifi_but_not_an_explicit_setting(https_url: str, tmp_path: Path,
                                                                          ca: tuple[Path, Path, Path]) -> None:
    assert await _post(_settings(), https_url, {"SSL_CERT_FILE": str(ca[0])}) == (200, None)
    (tmp_path / "other").mkdir()
    other = make_tls_files(tmp_path / "other")[0]  # an explicit setting wins over SSL_CERT_FILE
    assert (await _post(_settings(OUTBOX_TLS_CA_FILE=str(other)), https_url, {"SSL_CERT_FILE": str(ca[0])}))[0] is None


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs `openssl rehash` to build a CA directory")
async def test_ca_dir_setting(https_url: str, tmp_path: Path, ca: tuple[Path, Path, Path]) -> None:
    directory = tmp_path / "cas"
    directory.mkdir()
    shutil.copy(ca[0], directory / "bench-ca.pem")
    subprocess.run(["openssl", "rehash", str(directory)], check=True, capture_output=True)
    assert await _post(_settings(OUTBOX_TLS_CA_DIR=str(directory)), https_url) == (200, None)


async def test_system_store_via_truststore_honours_ssl_cert_file(https_url: str, ca: tuple[Path, Path, Path],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import truststore

    settings = _settings(OUTBOX_TLS_TRUST="system")
    assert isinstance(tls_context(settings, {}), truststore.SSLContext)
    assert (await _post(settings, https_url))[0] is None  # the private CA is not in the system store
    monkeypatch.setenv("SSL_CERT_FILE", str(ca[0]))  # OpenSSL's default paths, read by truststore on Linux
    assert await _post(settings, https_url) == (200, None)


@pytest.mark.parametrize(("env", "message"), [
    ({"OUTBOX_TLS_CA_FILE": "/nonexistent/ca.pem"}, "OUTBOX_TLS_CA_FILE: /nonexistent/ca.pem is not a readable file"),
    ({"OUTBOX_TLS_CA_DIR": "/nonexistent"}, "OUTBOX_TLS_CA_DIR: /nonexistent is not a directory"),
    ({"OUTBOX_TLS_TRUST": "windows"}, "OUTBOX_TLS_TRUST must be certifi or system"),
])
def test_bad_trust_settings_fail_in_one_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        tls_context(_settings(**env), {})


def test_a_file_without_certificates_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.pem"
    empty.write_text("not a certificate\n")
    with pytest.raises(ConfigurationError, match="OUTBOX_TLS_CA_FILE: no usable PEM certificates"):
        tls_context(_settings(OUTBOX_TLS_CA_FILE=str(empty)), {})
    with pytest.raises(ConfigurationError, match="SSL_CERT_FILE: no usable PEM certificates"):
        tls_context(_settings(), {"SSL_CERT_FILE": str(empty)})


def _authority(name: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None,
               key_usage: bool = True) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A CA certificate for ``name``, self-signed or issued by ``issuer``."""
    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    signer_name, signer_key = (subject, key) if issuer is None else (issuer[0].subject, issuer[1])
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(signer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True))
    if key_usage:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=False, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    return builder.sign(signer_key, hashes.SHA256()), key


def _leaf_chain(directory: Path, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey]) -> tuple[Path, Path]:
    """A leaf for 127.0.0.1 issued by ``issuer``, written with ``issuer``'s certificate after it
    (the chain a server sends), and its key."""
    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "leaf")]))
            .issuer_name(issuer[0].subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(issuer[1], hashes.SHA256()))
    chain, key_file = directory / "chain.pem", directory / "leaf-key.pem"
    chain.write_bytes(b"".join(c.public_bytes(serialization.Encoding.PEM) for c in (leaf, issuer[0])))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return chain, key_file


def _pem(directory: Path, name: str, cert: x509.Certificate) -> Path:
    path = directory / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


@pytest.mark.parametrize("key_usage", [True, False])
async def test_trust_is_the_same_on_every_python_as_curl_cacert(tmp_path: Path, key_usage: bool) -> None:
    """A pinned intermediate is trusted (as ``curl --cacert`` does), and so is a CA without a
    keyUsage extension: Python 3.13 turned both the other way by default, so the same
    OUTBOX_TLS_CA_FILE delivered on one interpreter and not on another."""
    root = _authority("root", key_usage=key_usage)
    intermediate = _authority("intermediate", root, key_usage=key_usage)
    chain, key_file = _leaf_chain(tmp_path, intermediate)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(chain, key_file)
    server = await serve(Receiver(None, None, scheme="https"), 0, server_ctx)
    url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/ok"
    try:
        for name, cert in (("root", root[0]), ("intermediate", intermediate[0])):
            assert await _post(_settings(OUTBOX_TLS_CA_FILE=str(_pem(tmp_path, name, cert))), url) == (200, None), name
    finally:
        server.close()


H2_ONLY = """
const http2 = require('http2'); const fs = require('fs');
const server = http2.createSecureServer({key: fs.readFileSync(process.argv[1]), cert: fs.readFileSync(process.argv[2])},
  (req, res) => { res.end('ok'); });
server.listen(0, '127.0.0.1', () => console.log(server.address().port));
"""


async def test_a_receiver_that_speaks_only_http2_fails_the_handshake_at_once(ca: tuple[Path, Path, Path]) -> None:
    """The sender offers ``http/1.1`` by ALPN, so an HTTP/2-only server refuses at the handshake
    with a reason; without it the server accepted the connection and stayed silent, and every
    attempt was recorded as a read timeout (a slow buyer, not one that cannot be spoken to)."""
    if shutil.which("node") is None:
        pytest.fail("node is not installed: this test runs Node's HTTP/2-only server (see .ci/run)")
    server = subprocess.Popen(["node", "-e", H2_ONLY, str(ca[2]), str(ca[1])], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        started = time.monotonic()
        status, error = await _post(_settings(OUTBOX_TLS_CA_FILE=str(ca[0])), f"https://127.0.0.1:{port}/h")
        assert status is None and time.monotonic() - started < 5
        assert error == "ConnectError: TLS handshake failed (TLSV1_ALERT_NO_APPLICATION_PROTOCOL)", error
    finally:
        server.kill()
        server.wait()
