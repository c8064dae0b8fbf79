"""Webhook authentication on the daemon's hot path: RFC 9421 signatures, legacy HMAC, Bearer.

Every attempt is signed afresh (new ``created``/``expires``/``nonce``; docs/protocol.md,
"Signing"), so signing cost is paid per attempt. The RFC 9421 signature base is therefore
built here with plain string formatting and signed with ``cryptography`` directly: the
AdCP webhook profile fixes the covered components and parameters, so a general
RFC 9421 library buys nothing at runtime and costs about 1 ms per signature, against
tens of microseconds for this module. ``http_message_signatures`` and the ``adcp`` SDK
stay in the test suite as oracles that pin this output byte for byte.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from outbox.errors import ConfigurationError
from outbox.urls import authority

__all__ = [
    "ADCP_USE_REQUEST",
    "ADCP_USE_WEBHOOK",
    "ALG_ED25519",
    "ALG_ES256",
    "COMPONENTS",
    "DEFAULT_ADCP_USE",
    "KeySource",
    "LABEL",
    "SigningKey",
    "TAG",
    "bearer_headers",
    "content_digest",
    "generate_signing_key_pem",
    "hmac_headers",
    "load_signing_key",
    "signature_base",
    "signature_headers",
]

# docs/protocol.md "Signing": the profile's algorithm allowlist, tag, label and the fixed,
# mandatory covered components (content-digest has no opt-out on webhooks).
ALG_ED25519 = "ed25519"
ALG_ES256 = "ecdsa-p256-sha256"
TAG = "adcp/webhook-signing/v1"
LABEL = "sig1"
COMPONENTS = ("@method", "@target-uri", "@authority", "content-type", "content-digest")
CONTENT_TYPE = "application/json"
MAX_VALIDITY_SECONDS = 300  # docs/protocol.md "Signing": expires - created <= 300
NONCE_BYTES = 16  # docs/protocol.md "Signing": nonce is >= 16 decoded bytes

# docs/protocol.md "Key purpose": the JWK ``adcp_use`` a webhook key is published with.
# AdCP 3.1+ verifiers accept both; AdCP 3.0 verifiers (the TypeScript @adcp/sdk 6.x among
# them) accept only the deprecated webhook-signing, so it is the default.
ADCP_USE_REQUEST = "request-signing"
ADCP_USE_WEBHOOK = "webhook-signing"
DEFAULT_ADCP_USE = ADCP_USE_WEBHOOK

_COVERED = "(" + " ".join(f'"{c}"' for c in COMPONENTS) + ")"
_JWK_ALG = {ALG_ED25519: "EdDSA", ALG_ES256: "ES256"}  # docs/protocol.md "Signing"

PrivateKey = Ed25519PrivateKey | ec.EllipticCurvePrivateKey
Clock = Callable[[], float]  # Unix time now; the daemon's is corrected to the database's


def _b64url(data: bytes) -> str:
    """Unpadded base64url: the webhook v1 encoding of ``Signature``, nonces and JWK members."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sf_string(value: str) -> str:
    """An RFC 8941 sf-string, so an operator's key id cannot break the header syntax."""
    if not (value.isascii() and value.isprintable()):
        raise ValueError(f"{value!r} is not printable ASCII, so it cannot go in Signature-Input")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _alg_of(private_key: object) -> str | None:
    """The profile algorithm a private key signs with, or ``None`` if the profile bans it."""
    if isinstance(private_key, Ed25519PrivateKey):
        return ALG_ED25519
    if isinstance(private_key, ec.EllipticCurvePrivateKey) and isinstance(private_key.curve, ec.SECP256R1):
        return ALG_ES256
    return None


@dataclass(frozen=True)
class SigningKey:
    """A private key with the ``kid`` buyers look it up by in the seller's JWKS (docs/protocol.md "Signing")."""

    key_id: str
    alg: str  # ALG_ED25519 | ALG_ES256
    private_key: PrivateKey

    def __post_init__(self) -> None:
        _sf_string(self.key_id)  # fail at load time, not on the first attempt
        if self.key_id != self.key_id.strip():  # published and compared exactly: "k1 " is not "k1"
            raise ValueError(f"key id {self.key_id!r} begins or ends with a space")
        if not self.key_id or _alg_of(self.private_key) != self.alg:
            raise ValueError(f"key {self.key_id!r}: needs a non-empty key id and a key matching alg {self.alg!r}")

    def public_members(self) -> dict[str, object]:
        """The public JWK without ``adcp_use``: what identifies the key, whatever its purpose."""
        public = self.private_key.public_key()
        if isinstance(public, ec.EllipticCurvePublicKey):
            numbers = public.public_numbers()
            members: dict[str, object] = {
                "kty": "EC",
                "crv": "P-256",
                "x": _b64url(numbers.x.to_bytes(32, "big")),
                "y": _b64url(numbers.y.to_bytes(32, "big")),
            }
        else:
            raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            members = {"kty": "OKP", "crv": "Ed25519", "x": _b64url(raw)}
        return {"kid": self.key_id, **members, "use": "sig", "key_ops": ["verify"], "alg": _JWK_ALG[self.alg]}

    def public_jwk(self, adcp_use: str = DEFAULT_ADCP_USE) -> dict[str, object]:
        """The JWK to publish at the seller's ``jwks_uri`` (docs/protocol.md "Key purpose")."""
        return {**self.public_members(), "adcp_use": adcp_use}

    def sign(self, data: bytes) -> bytes:
        """Raw signature bytes; ES256 as IEEE P1363 ``r||s`` (64 bytes), not DER (docs/protocol.md "Signing")."""
        if isinstance(self.private_key, Ed25519PrivateKey):
            return self.private_key.sign(data)
        r, s = decode_dss_signature(self.private_key.sign(data, ec.ECDSA(hashes.SHA256())))
        return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def _read_error(path: str | os.PathLike[str], exc: OSError) -> ConfigurationError:
    return ConfigurationError(f"signing key file {os.fspath(path)}: cannot read it ({exc.strerror})")


def readable_by_others(path: str | os.PathLike[str]) -> bool:
    """True when anyone on the host may read ``path`` (its "other" read bit is set), as ``ssh``
    would complain of for a private key. Group read is left alone: a Kubernetes Secret mounted
    with ``defaultMode: 0440`` and an ``fsGroup`` is the documented way to hand the key over."""
    try:
        return bool(os.stat(path).st_mode & stat.S_IROTH)
    except OSError:
        return False  # unreadable files are reported by load_signing_key


def _private_key_from_jwk(jwk: object, where: str) -> PrivateKey:
    if not isinstance(jwk, dict) or "d" not in jwk:
        raise ConfigurationError(f"{where}: a JSON key file must be a private JWK (with 'd')")
    kty, crv = jwk.get("kty"), jwk.get("crv")
    d = _b64url_decode(str(jwk["d"]))
    if (kty, crv) == ("OKP", "Ed25519"):
        return Ed25519PrivateKey.from_private_bytes(d)
    if (kty, crv) == ("EC", "P-256"):
        return ec.derive_private_key(int.from_bytes(d, "big"), ec.SECP256R1())
    raise ConfigurationError(f"{where}: unsupported JWK kty/crv {kty}/{crv} (need OKP/Ed25519 or EC/P-256)")


def load_signing_key(path: str | os.PathLike[str], key_id: str | None = None) -> SigningKey:
    """Load ``OUTBOX_SIGNING_KEY_FILE``: an unencrypted PEM private key or a private JWK.

    ``key_id`` is required for PEM (a PEM has no ``kid``) and overrides a JWK's ``kid``.
    Every failure is a one-line :class:`ConfigurationError` naming the file, never quoting
    its content, so a misconfiguration can be logged without leaking the key.
    """
    where = f"signing key file {os.fspath(path)}"
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise _read_error(path, exc) from None
    jwk = None
    try:
        if data.lstrip().startswith(b"{"):
            jwk = json.loads(data)
            private_key: object = _private_key_from_jwk(jwk, where)
            kid = jwk.get("kid")
            key_id = key_id or (kid if isinstance(kid, str) else None)
        else:
            private_key = serialization.load_pem_private_key(data, password=None)
    except ConfigurationError:
        raise
    except TypeError:  # cryptography: "Password was not given but private key is encrypted"
        raise ConfigurationError(f"{where}: the key is encrypted; outboxd needs an unencrypted key") from None
    except (ValueError, UnsupportedAlgorithm):  # never chain: the cause may quote the file
        raise ConfigurationError(f"{where}: not a PEM private key or a private JWK") from None
    alg = _alg_of(private_key)
    if alg is None:
        curve = getattr(getattr(private_key, "curve", None), "name", "")
        raise ConfigurationError(
            f"{where}: unsupported key type {type(private_key).__name__} {curve}".rstrip()
            + " (need Ed25519 or EC P-256)"
        )
    if not key_id:
        raise ConfigurationError(f"{where}: no key id (set OUTBOX_SIGNING_KEY_ID to the 'kid' you publish)")
    try:
        key = SigningKey(key_id, alg, cast(PrivateKey, private_key))
    except ValueError as exc:
        raise ConfigurationError(f"{where}: {exc}") from None
    # A JWK whose x/y disagree with d would make us publish one key and sign with another.
    if jwk is not None and any(jwk.get(n, v) != v for n, v in key.public_members().items() if n in ("x", "y")):
        raise ConfigurationError(f"{where}: the JWK's public members x/y do not match its 'd'")
    return key


def generate_signing_key_pem(alg: str = ALG_ED25519) -> bytes:
    """A fresh unencrypted PKCS#8 PEM private key (``outboxd keys``, tests, the demo)."""
    if alg == ALG_ED25519:
        private_key: PrivateKey = Ed25519PrivateKey.generate()
    elif alg == ALG_ES256:
        private_key = ec.generate_private_key(ec.SECP256R1())
    else:
        raise ValueError(f"alg must be {ALG_ED25519!r} or {ALG_ES256!r}, got {alg!r}")
    return private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def content_digest(body: bytes) -> str:
    """RFC 9530 ``Content-Digest`` of the exact wire bytes.

    Standard padded base64, as official vector 001 and the SDK emit it; the docs say
    base64url, but verifiers accept both alphabets for the digest (docs/protocol.md "Signing").
    """
    return f"sha-256=:{base64.b64encode(hashlib.sha256(body).digest()).decode('ascii')}:"


def signature_base(*, method: str, url: str, content_type: str, content_digest: str, params: str) -> str:
    """The RFC 9421 §2.5 signature base for the profile's fixed components (docs/protocol.md "Signing").

    ``url`` must already be canonical (``outbox.urls.canonicalize_url``): it is both the
    ``@target-uri`` and the URL the daemon POSTs to. ``params`` is the serialized
    ``@signature-params`` value, i.e. ``Signature-Input`` without its ``sig1=`` label.
    """
    return (
        f'"@method": {method}\n'
        f'"@target-uri": {url}\n'
        f'"@authority": {authority(url)}\n'
        f'"content-type": {content_type}\n'
        f'"content-digest": {content_digest}\n'
        f'"@signature-params": {params}'
    )


def signature_headers(
    key: SigningKey,
    *,
    url: str,
    body: bytes,
    digest: str | None = None,
    created: int | None = None,
    nonce: str | None = None,
    expires_in: int = MAX_VALIDITY_SECONDS,
    method: str = "POST",
    clock: Clock = time.time,
) -> dict[str, str]:
    """The four headers of an AdCP RFC 9421 webhook signature (docs/protocol.md "Signing"), fresh per attempt.

    ``url`` must be canonical. ``digest`` may be passed precomputed (the body never
    changes across attempts, docs/architecture.md, "Exact bytes") and must then equal
    ``content_digest(body)``. Raises ``ValueError`` for a validity outside 1..300 s or a
    URL that is not ASCII (an RFC 9421 signature base is ASCII; a client would
    percent-encode such a URL on the wire and the signature would not verify).
    ``clock`` gives ``created`` when it is not passed: the daemon passes its
    database-corrected clock (``supervisor.cycle.clock``).
    """
    if not 1 <= expires_in <= MAX_VALIDITY_SECONDS:
        raise ValueError(f"expires_in must be 1..{MAX_VALIDITY_SECONDS} seconds ('Signing' in docs/protocol.md), "
                         f"got {expires_in}")
    if created is None:
        created = int(clock())
    if nonce is None:
        nonce = _b64url(secrets.token_bytes(NONCE_BYTES))
    if digest is None:
        digest = content_digest(body)
    # docs/protocol.md "Signing" parameter order, as in the official vectors.
    params = (
        f"{_COVERED};created={created};expires={created + expires_in};nonce={_sf_string(nonce)};"
        f'keyid={_sf_string(key.key_id)};alg="{key.alg}";tag="{TAG}"'
    )
    base = signature_base(method=method, url=url, content_type=CONTENT_TYPE, content_digest=digest, params=params)
    return {
        "Content-Type": CONTENT_TYPE,
        "Content-Digest": digest,
        "Signature-Input": f"{LABEL}={params}",
        "Signature": f"{LABEL}=:{_b64url(key.sign(base.encode('ascii')))}:",
    }


def hmac_headers(secret: bytes, body: bytes, timestamp: int | None = None, clock: Clock = time.time) -> dict[str, str]:
    """Legacy HMAC-SHA256 headers (docs/protocol.md "Legacy credentials"): ``sha256=<hex>`` over ``b"<ts>." + body``.

    Only for registrations that carry ``authentication`` (docs/protocol.md "Legacy credentials"); a fresh timestamp per
    attempt keeps retries inside the receiver's 300 s replay window.
    """
    ts = str(int(clock()) if timestamp is None else timestamp)
    mac = hmac.new(secret, ts.encode("ascii") + b"." + body, hashlib.sha256).hexdigest()
    return {"X-ADCP-Signature": f"sha256={mac}", "X-ADCP-Timestamp": ts}


def bearer_headers(token: str) -> dict[str, str]:
    """Legacy Bearer authentication ("Legacy credentials"): no body integrity, only for opted-in buyers."""
    return {"Authorization": f"Bearer {token}"}


class KeySource(Protocol):
    """Where an attempt gets its key: ``supervisor.keys.keyring_cache.CachedKeyring`` in the daemon,
    which picks the tenant's scope's active key at the moment of the attempt."""

    def resolve(self, tenant_id: str) -> SigningKey:
        """The key to sign ``tenant_id``'s webhook with now; ``ConfigurationError`` if none can."""
        ...
