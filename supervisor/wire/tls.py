"""Which certificate authorities the daemon trusts when it sends over HTTPS.

Operators expect the conventions of curl, requests and OpenSSL, so the order is:

1. ``OUTBOX_TLS_CA_FILE`` (a PEM bundle) and/or ``OUTBOX_TLS_CA_DIR`` (an OpenSSL hashed
   directory, ``c_rehash``): trust exactly these, e.g. a corporate or private CA;
2. otherwise ``OUTBOX_TLS_TRUST=system``: the operating system's trust store through the
   ``truststore`` package (Linux: OpenSSL's default paths, which honour ``SSL_CERT_FILE`` and
   ``SSL_CERT_DIR``; macOS and Windows: the native verifier);
3. otherwise (``OUTBOX_TLS_TRUST=certifi``, the default): ``SSL_CERT_FILE`` and/or
   ``SSL_CERT_DIR`` when set (as httpx, requests and OpenSSL honour them), else the
   ``certifi`` bundle: the same roots everywhere, whatever the base image ships.

The context is built once per process (per choice): building one costs tens of ms of CPU.
"""

from __future__ import annotations

import functools
import os
import ssl
from collections.abc import Mapping

from outbox.config import Settings
from outbox.errors import ConfigurationError

TRUST_SOURCES = ("certifi", "system")


def _locations(cafile: str | None, capath: str | None, names: tuple[str, str]) -> ssl.SSLContext:
    """A client context trusting exactly ``cafile``/``capath``; errors name the variable."""
    if cafile is not None and not os.path.isfile(cafile):
        raise ConfigurationError(f"{names[0]}: {cafile} is not a readable file")
    if capath is not None and not os.path.isdir(capath):
        raise ConfigurationError(f"{names[1]}: {capath} is not a directory")
    try:
        return ssl.create_default_context(cafile=cafile, capath=capath)
    except (ssl.SSLError, OSError) as exc:
        which = names[0] if cafile is not None else names[1]
        raise ConfigurationError(f"{which}: no usable PEM certificates ({type(exc).__name__})") from None


def tls_context(settings: Settings, env: Mapping[str, str] | None = None) -> ssl.SSLContext:
    """The verifying client context for every HTTPS delivery, by the order above."""
    env = os.environ if env is None else env
    return _context(settings.tls_ca_file or None, settings.tls_ca_dir or None, settings.tls_trust,
                    env.get("SSL_CERT_FILE") or None, env.get("SSL_CERT_DIR") or None)


@functools.lru_cache(maxsize=8)
def _context(ca_file: str | None, ca_dir: str | None, trust: str, cert_file: str | None,
             cert_dir: str | None) -> ssl.SSLContext:
    """Built once per process and choice: parsing the certifi bundle takes tens of ms of CPU."""
    if ca_file or ca_dir:
        return _locations(ca_file, ca_dir, ("OUTBOX_TLS_CA_FILE", "OUTBOX_TLS_CA_DIR"))
    if trust == "system":
        import truststore

        return truststore.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if cert_file or cert_dir:
        return _locations(cert_file, cert_dir, ("SSL_CERT_FILE", "SSL_CERT_DIR"))
    import certifi

    return ssl.create_default_context(cafile=certifi.where())
