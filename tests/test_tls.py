"""HTTPS trust as operators configure it (supervisor/wire/tls.py): a private CA by file or
directory, SSL_CERT_FILE / SSL_CERT_DIR, the system store via truststore, certifi by default.
Each case POSTs to a real TLS receiver on 127.0.0.1 whose certificate a throwaway CA signed."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

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
