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
A TLS failure is named for the operator from OpenSSL's codes (:func:`tls_failure`), never
with the library's own text.
"""

from __future__ import annotations

import functools
import os
import re
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
        return _as_curl_verifies(ssl.create_default_context(cafile=cafile, capath=capath))
    except (ssl.SSLError, OSError) as exc:
        which = names[0] if cafile is not None else names[1]
        raise ConfigurationError(f"{which}: no usable PEM certificates ({type(exc).__name__})") from None


def _as_curl_verifies(context: ssl.SSLContext) -> ssl.SSLContext:
    """Chain checks fixed, not left to the interpreter's defaults, which Python 3.13 changed: a
    trusted intermediate ends a chain (OpenSSL's partial chains, as ``curl --cacert`` has it),
    and RFC 5280's strict profile is not applied (a private CA without a keyUsage extension
    still verifies), so one OUTBOX_TLS_CA_FILE delivers alike on every supported Python."""
    context.verify_flags = (context.verify_flags | ssl.VERIFY_X509_PARTIAL_CHAIN) & ~ssl.VERIFY_X509_STRICT
    return context


def _speaking_http1(context: ssl.SSLContext) -> ssl.SSLContext:
    """Offer ``http/1.1`` by ALPN, the only protocol the sender speaks: a receiver that speaks
    only HTTP/2 then refuses at the handshake with a reason, where without ALPN it accepts the
    connection and stays silent until the read timeout, and the buyer looks slow."""
    context.set_alpn_protocols(["http/1.1"])
    return context


def tls_context(settings: Settings, env: Mapping[str, str] | None = None) -> ssl.SSLContext:
    """The verifying client context for every HTTPS delivery, by the order above."""
    env = os.environ if env is None else env
    return _context(settings.tls_ca_file or None, settings.tls_ca_dir or None, settings.tls_trust,
                    env.get("SSL_CERT_FILE") or None, env.get("SSL_CERT_DIR") or None)


def sender_context(settings: Settings, verify: ssl.SSLContext | str | None = None) -> ssl.SSLContext:
    """The context an ``HttpSender`` connects with, built once: creating one per connection
    costs milliseconds of CPU. ``None`` (the daemon): :func:`tls_context`; a context, or a CA
    file or directory path, otherwise (tests)."""
    if verify is None:
        return tls_context(settings)
    if isinstance(verify, ssl.SSLContext):
        return verify
    if os.path.isdir(verify):
        return _speaking_http1(_as_curl_verifies(ssl.create_default_context(capath=verify)))
    return _speaking_http1(_as_curl_verifies(ssl.create_default_context(cafile=verify)))


@functools.lru_cache(maxsize=8)
def _context(ca_file: str | None, ca_dir: str | None, trust: str, cert_file: str | None,
             cert_dir: str | None) -> ssl.SSLContext:
    """Built once per process and choice: parsing the certifi bundle takes tens of ms of CPU."""
    if ca_file or ca_dir:
        return _speaking_http1(_locations(ca_file, ca_dir, ("OUTBOX_TLS_CA_FILE", "OUTBOX_TLS_CA_DIR")))
    if trust == "system":
        import truststore

        return _speaking_http1(truststore.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
    if cert_file or cert_dir:
        return _speaking_http1(_locations(cert_file, cert_dir, ("SSL_CERT_FILE", "SSL_CERT_DIR")))
    import certifi

    return _speaking_http1(_as_curl_verifies(ssl.create_default_context(cafile=certifi.where())))


# OpenSSL's X509_V_ERR_* codes, by what the operator has to fix. The library's own message
# is never stored: for a name mismatch it quotes the host name.
_CERTIFICATE_CAUSES = {
    62: "TLS certificate name mismatch (not valid for this host)",  # HOSTNAME_MISMATCH
    64: "TLS certificate name mismatch (not valid for this address)",  # IP_ADDRESS_MISMATCH
    10: "TLS certificate expired",  # CERT_HAS_EXPIRED
    9: "TLS certificate not yet valid",  # CERT_NOT_YET_VALID
    **dict.fromkeys((2, 18, 19, 20, 21, 27), "TLS certificate from an unknown authority"),  # no trusted issuer
    23: "TLS certificate revoked",  # CERT_REVOKED
}
_OPENSSL_REASON = re.compile(r"[A-Z0-9_]{1,64}")
_UNNAMED_REASON = re.compile(r"\[[A-Z0-9_]{1,16}\] ([a-z0-9 ]{1,64}) \(_ssl\.c:\d+\)")


def tls_failure(exc: ssl.SSLError, failed: str = "TLS error") -> str:
    """Why TLS failed, named for the operator (docs/protocol.md "Attempt records")."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        code = exc.verify_code  # None from a platform verifier (truststore on macOS, Windows)
        if not isinstance(code, int):
            return "TLS certificate verification failed"
        return _CERTIFICATE_CAUSES.get(code, f"TLS certificate verification failed (verify code {code})")
    reason = exc.reason if isinstance(exc.reason, str) and _OPENSSL_REASON.fullmatch(exc.reason) else None
    if reason is None:  # a code Python's table lacks (an ALPN refusal): OpenSSL's own words, in its style
        words = _UNNAMED_REASON.fullmatch(str(exc.args[1]) if len(exc.args) > 1 else "")
        reason = words.group(1).upper().replace(" ", "_") if words else None
    return f"{failed} ({reason})" if reason else failed
