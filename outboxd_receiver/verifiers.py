"""Independent RFC 9421 verifiers for the test receiver: ``http_message_signatures`` or the
``adcp`` SDK's ``verify_webhook_signature`` (the oracle), each behind one small signature.

A verifier takes (method, url, lower-cased headers, body) and returns ``None`` when the
signature holds, or the AdCP error code that a real receiver would put in its challenge.
"""

from __future__ import annotations

import base64
import datetime
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

Verifier = Callable[[str, str, dict[str, str], bytes], str | None]


def library_verifier(public_jwks: dict[str, Any]) -> Verifier:
    """Verify with ``http_message_signatures`` (RFC 9421), AdCP webhook profile checks on top."""
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519
    from http_message_signatures import HTTPMessageVerifier, algorithms
    from http_message_signatures.resolvers import HTTPSignatureKeyResolver

    def _b64(value: str) -> bytes:
        return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))

    keys: dict[str, tuple[Any, Any]] = {}
    for jwk in public_jwks.get("keys", []):
        if jwk.get("kty") == "OKP":
            keys[jwk["kid"]] = (ed25519.Ed25519PublicKey.from_public_bytes(_b64(jwk["x"])), algorithms.ED25519)
        else:
            numbers = ec.EllipticCurvePublicNumbers(int.from_bytes(_b64(jwk["x"]), "big"),
                                                    int.from_bytes(_b64(jwk["y"]), "big"), ec.SECP256R1())
            keys[jwk["kid"]] = (numbers.public_key(), algorithms.ECDSA_P256_SHA256)

    class _Keys(HTTPSignatureKeyResolver):
        def resolve_public_key(self, key_id: str) -> Any:
            return keys[key_id][0]

    def verify(method: str, url: str, headers: dict[str, str], body: bytes) -> str | None:
        sig_input = headers.get("signature-input", "")
        if 'tag="adcp/webhook-signing/v1"' not in sig_input:
            return "webhook_signature_tag_invalid"
        kid = sig_input.split('keyid="', 1)[-1].split('"', 1)[0]
        if kid not in keys:
            return "webhook_signature_key_unknown"
        # AdCP webhook v1 sends Signature as unpadded base64url (docs/protocol.md, "Signing");
        # RFC 8941 byte sequences are padded standard base64: translate before verifying.
        label, _, value = headers.get("signature", "").partition("=")
        raw = _b64(value.strip(":"))
        converted = {**headers, "signature": f"{label}=:{base64.b64encode(raw).decode()}:"}
        message = SimpleNamespace(method=method, url=url, headers=converted)
        try:
            HTTPMessageVerifier(signature_algorithm=keys[kid][1], key_resolver=_Keys()).verify(
                message, max_age=datetime.timedelta(seconds=360),
                expect_tag="adcp/webhook-signing/v1",
                require_components=("@method", "@target-uri", "@authority", "content-type", "content-digest"),
                body=body)
        except Exception as exc:
            return f"webhook_signature_invalid ({type(exc).__name__})"
        return None

    return verify


def adcp_verifier(public_jwks: dict[str, Any]) -> Verifier:
    """Verify with the ``adcp`` SDK's ``verify_webhook_signature`` and a static JWKS."""
    from adcp.signing import StaticJwksResolver  # adcp.webhooks would cost ~17 s to import
    from adcp.signing.webhook_verifier import WebhookVerifyOptions, verify_webhook_signature

    resolver = StaticJwksResolver(public_jwks)

    def verify(method: str, url: str, headers: dict[str, str], body: bytes) -> str | None:
        try:
            verify_webhook_signature(method=method, url=url, headers=headers, body=body,
                                     options=WebhookVerifyOptions(jwks_resolver=resolver))
        except Exception as exc:
            return getattr(exc, "code", None) or type(exc).__name__
        return None

    return verify


def served_jwks_verifier(jwks_urls: list[str], revocation_url: str | None = None,
                         issuer: str | None = None) -> Verifier:
    """The ``adcp`` SDK's verifier against the JWKS served right now: fetched again for every
    request (round robin over ``jwks_urls``), as by a buyer whose cache just expired; with
    ``revocation_url``, the SDK also fetches and checks the signed revocation list each time."""
    import httpx
    from adcp.signing import CachingRevocationChecker, FetchResult, InMemoryReplayStore, StaticJwksResolver
    from adcp.signing.webhook_verifier import WebhookVerifyOptions, verify_webhook_signature

    replays = InMemoryReplayStore()
    turn = iter(range(sys.maxsize))
    client = httpx.Client(timeout=5)  # one client: building one costs more than the fetch

    def fetch_list(uri: str, **_: Any) -> Any:
        return FetchResult(body=client.get(uri).json(), etag=None)

    def verify(method: str, url: str, headers: dict[str, str], body: bytes) -> str | None:
        try:
            resolver = StaticJwksResolver(client.get(jwks_urls[next(turn) % len(jwks_urls)]).json())
            revocations = None if revocation_url is None else CachingRevocationChecker(
                revocation_uri=revocation_url, issuer=issuer or "", jwks_resolver=resolver, fetcher=fetch_list)
            verify_webhook_signature(method=method, url=url, headers=headers, body=body, options=WebhookVerifyOptions(
                jwks_resolver=resolver, revocation_checker=revocations, replay_store=replays))
        except Exception as exc:
            return getattr(exc, "code", None) or type(exc).__name__
        return None

    return verify
