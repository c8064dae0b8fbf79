"""supervisor.wire.signing against three independent oracles.

1. The official AdCP webhook-signing conformance vectors bundled with the ``adcp`` SDK.
2. The SDK's own verifiers (RFC 9421 webhook profile and legacy HMAC).
3. The ``http_message_signatures`` RFC 9421 library, property-tested with hypothesis.
"""

from __future__ import annotations

import base64
import datetime
import importlib.resources
import json
import os
import string
import time
from pathlib import Path
from types import SimpleNamespace

import http_sf
import pytest
from adcp.signing import StaticJwksResolver
from adcp.signing.errors import SignatureVerificationError
from adcp.signing.webhook_hmac import LegacyWebhookHmacError, LegacyWebhookHmacOptions, verify_webhook_hmac
# adcp.webhooks re-exports these two, but importing it costs 17 s against 5 s for the defining module.
from adcp.signing.webhook_verifier import WebhookVerifyOptions, verify_webhook_signature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from http_message_signatures import ContentDigest, HTTPMessageSigner, HTTPMessageVerifier, MappingKeyResolver
from http_message_signatures import algorithms as hms_algorithms
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox.errors import ConfigurationError
from outbox.urls import canonicalize_url
from supervisor.wire.signing import (
    ALG_ED25519,
    ALG_ES256,
    COMPONENTS,
    LABEL,
    TAG,
    SigningKey,
    bearer_headers,
    content_digest,
    generate_signing_key_pem,
    hmac_headers,
    load_signing_key,
    signature_base,
    signature_headers,
)

BODY = b'{"idempotency_key":"whk_0123456789abcdef","task_id":"t1","status":"completed"}'
URL = "https://buyer.example.com/adcp/webhook?b=2&a=1"


def _unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _signature_bytes(header: str) -> bytes:
    label, _, value = header.partition("=")
    assert label == LABEL and value.startswith(":") and value.endswith(":")
    assert "=" not in value and "+" not in value and "/" not in value, "Signature must be unpadded base64url"
    return _unb64url(value[1:-1])


# --------------------------------------------------------------------------- vectors


def _vectors_dir() -> Path:
    """The webhook-signing vectors of the newest compliance version the SDK bundles."""
    root = Path(str(importlib.resources.files("adcp") / "_compliance"))
    versions = [p for p in root.iterdir() if (p / "test-vectors" / "webhook-signing" / "keys.json").is_file()]
    assert versions, f"no webhook-signing vectors under {root}"
    newest = max(versions, key=lambda p: tuple(int(n) for n in p.name.split(".")))
    return newest / "test-vectors" / "webhook-signing"


VECTORS = _vectors_dir()
VECTOR_KEYS = {k["kid"]: k for k in json.loads((VECTORS / "keys.json").read_text())["keys"]}
POSITIVE = sorted((VECTORS / "positive").glob("*.json"))


def _public_jwk(jwk: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in jwk.items() if not k.startswith(("_", "$"))}


def _vector_key(tmp_path: Path, kid: str) -> SigningKey:
    """The vector's key, loaded through our JWK path from a private JWK file."""
    private = {**_public_jwk(VECTOR_KEYS[kid]), "d": VECTOR_KEYS[kid]["_private_d_for_test_only"]}
    path = tmp_path / f"{kid}.jwk"
    path.write_text(json.dumps(private))
    return load_signing_key(path)


def _sdk_verify(*, url: str, headers: dict[str, str], body: bytes, jwk: dict[str, object], now: float) -> str:
    options = WebhookVerifyOptions(jwks_resolver=StaticJwksResolver({"keys": [jwk]}), clock=lambda: now)
    return verify_webhook_signature(method="POST", url=url, headers=headers, body=body, options=options).key_id


def test_vectors_found() -> None:
    assert len(POSITIVE) >= 8, POSITIVE  # a silently empty parametrization would pass


@pytest.mark.parametrize("path", POSITIVE, ids=lambda p: p.stem)
def test_positive_vector(path: Path, tmp_path: Path) -> None:
    vec = json.loads(path.read_text())
    request, expected_headers = vec["request"], vec["request"]["headers"]
    body = request["body"].encode()
    # 003 carries a second label ("relay") that a verifier must ignore. A signer emits only
    # its own sig1, so the vector still applies: our headers must equal its sig1 members.
    sig_inputs = http_sf.parse(expected_headers["Signature-Input"].encode(), tltype="dictionary")
    components, params = sig_inputs[LABEL]
    assert tuple(c for c, _ in components) == COMPONENTS
    key = _vector_key(tmp_path, params["keyid"])
    assert key.alg == params["alg"] and key.public_jwk()["x"] == VECTOR_KEYS[params["keyid"]]["x"]

    # 004 (explicit :443) and 005 (lowercase %xx) sign the canonical URL, not the raw one;
    # the others are already canonical.
    url = canonicalize_url(request["url"])
    assert (url != request["url"]) == path.stem.startswith(("004", "005"))

    ours = signature_headers(key, url=url, body=body, created=params["created"], nonce=params["nonce"])
    assert ours["Content-Type"] == expected_headers["Content-Type"]
    assert ours["Content-Digest"] == expected_headers["Content-Digest"] == content_digest(body)
    assert params["expires"] - params["created"] == 300
    sig1_input = http_sf.ser({LABEL: sig_inputs[LABEL]})
    assert ours["Signature-Input"] == sig1_input
    if len(sig_inputs) == 1:
        assert ours["Signature-Input"] == expected_headers["Signature-Input"]
    else:
        assert expected_headers["Signature-Input"].startswith(ours["Signature-Input"] + ", ")

    base = signature_base(
        method="POST",
        url=url,
        content_type=ours["Content-Type"],
        content_digest=ours["Content-Digest"],
        params=ours["Signature-Input"].removeprefix(f"{LABEL}="),
    )
    assert base == vec["expected_signature_base"]

    public = key.private_key.public_key()
    if key.alg == ALG_ED25519:  # deterministic: byte for byte
        assert ours["Signature"] == expected_headers["Signature"]
    else:  # ECDSA is randomized: P1363 r||s that verifies, and the vector's verifies too
        for header in (ours["Signature"], expected_headers["Signature"]):
            raw = _signature_bytes(header)
            assert len(raw) == 64
            r, s = int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big")
            public.verify(encode_dss_signature(r, s), base.encode(),  # type: ignore[call-arg]
                          ec.ECDSA(hashes.SHA256()))

    jwk = _public_jwk(VECTOR_KEYS[params["keyid"]])
    # The SDK verifier sees the URL as sent by the vector's client (e.g. with :443).
    assert _sdk_verify(url=request["url"], headers=ours, body=body, jwk=jwk, now=vec["reference_now"]) == key.key_id


# --------------------------------------------------------------------------- SDK verifier


@pytest.fixture(params=[ALG_ED25519, ALG_ES256])
def key(request: pytest.FixtureRequest, tmp_path: Path) -> SigningKey:
    path = tmp_path / "key.pem"
    path.write_bytes(generate_signing_key_pem(request.param))
    return load_signing_key(path, f"outboxd-{request.param}")


def test_sdk_verifies_our_signature(key: SigningKey) -> None:
    headers = signature_headers(key, url=URL, body=BODY)
    jwk = key.public_jwk()
    assert jwk["adcp_use"] == "webhook-signing" and jwk["key_ops"] == ["verify"] and jwk["use"] == "sig"
    assert jwk["alg"] == {ALG_ED25519: "EdDSA", ALG_ES256: "ES256"}[key.alg]
    assert _sdk_verify(url=URL, headers=headers, body=BODY, jwk=jwk, now=time.time()) == key.key_id
    if key.alg == ALG_ES256:
        assert len(_signature_bytes(headers["Signature"])) == 64  # P1363, not DER


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"body": BODY + b" "}, "webhook_signature_digest_mismatch"),
        ({"url": URL.replace("a=1", "a=2")}, "webhook_signature_invalid"),
        ({"now": time.time() + 3600}, "webhook_signature_window_invalid"),
    ],
)
def test_sdk_rejects_tampering(key: SigningKey, change: dict[str, object], code: str) -> None:
    headers = signature_headers(key, url=URL, body=BODY)
    args: dict[str, object] = {"url": URL, "body": BODY, "now": time.time(), **change}
    with pytest.raises(SignatureVerificationError) as err:
        _sdk_verify(headers=headers, jwk=key.public_jwk(), **args)  # type: ignore[arg-type]
    assert err.value.code == code


def test_each_attempt_gets_fresh_nonce_and_time() -> None:
    key = SigningKey("k", ALG_ED25519, Ed25519PrivateKey.generate())
    before = int(time.time())
    first, second = (signature_headers(key, url=URL, body=BODY) for _ in range(2))
    params = http_sf.parse(first["Signature-Input"].encode(), tltype="dictionary")[LABEL][1]
    assert before <= params["created"] <= int(time.time())
    assert params["expires"] == params["created"] + 300
    nonce = params["nonce"]
    assert "=" not in nonce and len(_unb64url(nonce)) >= 16 and _unb64url(nonce) != b"\0" * 16
    assert first["Signature-Input"] != second["Signature-Input"]
    assert first["Content-Digest"] == second["Content-Digest"]


def test_validity_bounds_and_precomputed_digest() -> None:
    key = SigningKey("k", ALG_ED25519, Ed25519PrivateKey.generate())
    for bad in (0, -1, 301):
        with pytest.raises(ValueError, match="expires_in"):
            signature_headers(key, url=URL, body=BODY, expires_in=bad)
    headers = signature_headers(key, url=URL, body=BODY, created=1000, expires_in=1, digest="sha-256=:AAAA:")
    assert ";created=1000;expires=1001;" in headers["Signature-Input"]
    assert headers["Content-Digest"] == "sha-256=:AAAA:"  # used verbatim, not recomputed


def test_unsignable_inputs_are_refused() -> None:
    key = SigningKey("k", ALG_ED25519, Ed25519PrivateKey.generate())
    with pytest.raises(ValueError):  # an RFC 9421 signature base is ASCII
        signature_headers(key, url="https://buyer.example.com/caf\u00e9", body=BODY)
    with pytest.raises(ValueError):
        SigningKey("k\u00e9", ALG_ED25519, Ed25519PrivateKey.generate())
    with pytest.raises(ValueError):
        SigningKey("k", ALG_ES256, Ed25519PrivateKey.generate())
    with pytest.raises(ValueError):
        SigningKey("", ALG_ED25519, Ed25519PrivateKey.generate())


# --------------------------------------------------------------------------- RFC 9421 library oracle


class _TimelessVerifier(HTTPMessageVerifier):
    """The library's verifier without its wall-clock checks: hypothesis picks ``created``."""

    def validate_created_and_expires(self, sig_input, max_age=None):  # type: ignore[no-untyped-def]
        pass


_ORACLE_KEYS = {
    ALG_ED25519: (SigningKey('ed "\\ key', ALG_ED25519, Ed25519PrivateKey.generate()), hms_algorithms.ED25519),
    ALG_ES256: (
        SigningKey("es-key", ALG_ES256, ec.generate_private_key(ec.SECP256R1())),
        hms_algorithms.ECDSA_P256_SHA256,
    ),
}
SIGNATURE_PARAMS = '"@signature-params"'
_UNRESERVED = frozenset(string.ascii_letters + string.digits + "-._~")
_PCHAR = st.one_of(
    st.sampled_from("ABCXYZabcxyz0189-._~!$&'()*+,;=:@"),
    # Escapes of unreserved characters are not canonical in a path (they decode).
    st.integers(0, 255).filter(lambda b: chr(b) not in _UNRESERVED).map(lambda b: f"%{b:02X}"),
)
_LABEL_RE = r"[a-z][a-z0-9]{0,5}(-[a-z0-9]{1,4})?"


@st.composite
def canonical_urls(draw: st.DrawFn) -> str:
    scheme = draw(st.sampled_from(["https", "http"]))
    host = draw(
        st.one_of(
            st.lists(st.from_regex(_LABEL_RE, fullmatch=True), min_size=1, max_size=4).map(".".join),
            st.ip_addresses(v=4).map(str),
            st.ip_addresses(v=6).map(lambda a: f"[{a}]"),
        )
    )
    default = {"https": 443, "http": 80}[scheme]
    port = draw(st.none() | st.integers(1, 65535).filter(lambda p: p != default))
    segment = st.lists(_PCHAR, max_size=6).map("".join).filter(lambda s: s not in (".", ".."))  # dot segments go
    segments = draw(st.lists(segment, min_size=1, max_size=4))
    # "'" is escaped in a canonical query (a WHATWG parser encodes it there, not in a path)
    query_char = _PCHAR.filter(lambda c: c != "'") | st.sampled_from("/?")
    query = draw(st.none() | st.lists(query_char, min_size=1, max_size=12).map("".join))
    url = f"{scheme}://{host}{'' if port is None else f':{port}'}/{'/'.join(segments)}"
    return url if query is None else f"{url}?{query}"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    url=canonical_urls(),
    body=st.binary(max_size=512),
    created=st.integers(0, 4_102_444_800),
    nonce=st.binary(min_size=16, max_size=32).map(lambda b: base64.urlsafe_b64encode(b).rstrip(b"=").decode()),
    expires_in=st.integers(1, 300),
    alg=st.sampled_from([ALG_ED25519, ALG_ES256]),
)
def test_matches_rfc9421_library(url: str, body: bytes, created: int, nonce: str, expires_in: int, alg: str) -> None:
    assert canonicalize_url(url) == url  # the strategy yields what the daemon would sign
    key, algorithm = _ORACLE_KEYS[alg]
    ours = signature_headers(key, url=url, body=body, created=created, nonce=nonce, expires_in=expires_in)
    our_params = ours["Signature-Input"].removeprefix(f"{LABEL}=")
    our_base = signature_base(
        method="POST", url=url, content_type="application/json", content_digest=ours["Content-Digest"],
        params=our_params
    )

    # The library signs the same request on its own: digest, component values, parameters.
    resolver = MappingKeyResolver(
        public_keys={key.key_id: key.private_key.public_key()}, private_keys={key.key_id: key.private_key}
    )
    theirs = SimpleNamespace(method="POST", url=url, headers={"Content-Type": "application/json"})
    prepared = HTTPMessageSigner(signature_algorithm=algorithm, key_resolver=resolver).prepare(
        theirs,
        key_id=key.key_id,
        created=datetime.datetime.fromtimestamp(created, datetime.timezone.utc),
        expires=datetime.datetime.fromtimestamp(created + expires_in, datetime.timezone.utc),
        nonce=nonce,
        label=LABEL,
        tag=TAG,
        covered_component_ids=COMPONENTS,
        body=body,
    )
    assert ours["Content-Digest"] == theirs.headers["Content-Digest"] == ContentDigest.create(body)
    their_lines = prepared.signature_base.decode().split("\n")
    assert our_base.split("\n")[:-1] == their_lines[:-1]  # every covered component value
    # It orders parameters its own way (RFC 9421 leaves order to the signer), so compare
    # the parsed Signature-Input, then byte for byte below.
    parse = lambda v: http_sf.parse(v.encode(), tltype="dictionary")[LABEL]  # noqa: E731
    assert parse(ours["Signature-Input"]) == parse(f"{LABEL}={prepared.signature_params}")

    # The library rebuilds the base from the message and our Signature-Input, re-serializes
    # our parameters exactly, and verifies our Signature and Content-Digest against them.
    # The one intended difference: AdCP webhook v1 keeps unpadded base64url for Signature
    # (docs/protocol.md "Signing") where RFC 8941 byte sequences are padded standard base64.
    signature = _signature_bytes(ours["Signature"])
    rfc8941 = {**ours, "Signature": f"{LABEL}=:{base64.b64encode(signature).decode()}:"}
    message = SimpleNamespace(method="POST", url=url, headers=rfc8941)
    [result] = _TimelessVerifier(signature_algorithm=algorithm, key_resolver=resolver).verify(
        message, max_age=None, expect_tag=TAG, require_components=COMPONENTS, body=body
    )
    library_base = "\n".join(f"{k}: {v}" for k, v in result.covered_components.items())
    assert our_base == library_base
    assert ours["Signature-Input"] == f"{LABEL}={result.covered_components[SIGNATURE_PARAMS]}"
    if alg == ALG_ED25519:  # deterministic, so the library's own signature is ours
        assert signature == algorithm(private_key=key.private_key).sign(our_base.encode())


# --------------------------------------------------------------------------- legacy HMAC and Bearer

HMAC_SECRET = b"cc237f7fe354609bb41360c6530a2deb7926f3cc55e91df3ff90e37202950b6c"


# The adcp package does not ship webhook-hmac-sha256.json; these rows are copied from the spec
# repository (adcontextprotocol/adcp static/test-vectors/webhook-hmac-sha256.json). The secret is
# used as the bytes of its ASCII text, as the spec's reference implementations do.
@pytest.mark.parametrize(
    ("timestamp", "body", "expected"),
    [
        (1700000000, b"{}", "06338bfc687c7a3677ea16420e527469d6717bb966451d29c685de8f0270f073"),
        (1700000000, b"", "d9f70ba6cb43e92a8f55c1fc73bec0f8f07fa3a652e1ec1d5ee69846cfde9fe8"),
        (0, b'{"event":"test"}', "e098ea1f745765614027918d988930b96c38a2f8e2b5d05560f4bffa53d77dcd"),
        (
            1700000000,
            '{"brand_name":"Café Münchën","tagline":"日本語テスト"}'.encode(),
            "0e445863247724694581d538497527218443961f15c9645d656b52d8fdca4f9c",
        ),
    ],
)
def test_hmac_spec_vectors(timestamp: int, body: bytes, expected: str) -> None:
    assert hmac_headers(HMAC_SECRET, body, timestamp) == {
        "X-ADCP-Signature": f"sha256={expected}",
        "X-ADCP-Timestamp": str(timestamp),
    }


@pytest.mark.filterwarnings("ignore:HMAC-SHA256 webhook verification:DeprecationWarning")
def test_hmac_verifies_with_sdk() -> None:
    secret = os.urandom(32)
    headers = hmac_headers(secret, BODY)
    assert abs(int(headers["X-ADCP-Timestamp"]) - time.time()) <= 2
    options = LegacyWebhookHmacOptions(secret=secret, sender_identity="seller", now=time.time())
    assert verify_webhook_hmac(headers=headers, body=BODY, options=options).sender_identity == "seller"
    with pytest.raises(LegacyWebhookHmacError):
        verify_webhook_hmac(headers=headers, body=BODY + b" ", options=options)


def test_bearer() -> None:
    assert bearer_headers("t" * 32) == {"Authorization": "Bearer " + "t" * 32}


# --------------------------------------------------------------------------- key loading


def _private_jwk(private_key: Ed25519PrivateKey | ec.EllipticCurvePrivateKey, kid: str) -> dict[str, object]:
    if isinstance(private_key, Ed25519PrivateKey):
        alg = ALG_ED25519
        d = private_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
    else:
        alg, d = ALG_ES256, private_key.private_numbers().private_value.to_bytes(32, "big")
    public = SigningKey(kid, alg, private_key).public_jwk()
    return {**public, "d": base64.urlsafe_b64encode(d).rstrip(b"=").decode()}


@pytest.mark.parametrize("alg", [ALG_ED25519, ALG_ES256])
def test_load_pem_and_jwk(alg: str, tmp_path: Path) -> None:
    pem = generate_signing_key_pem(alg)
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8, unencrypted
    (tmp_path / "k.pem").write_bytes(pem)
    from_pem = load_signing_key(tmp_path / "k.pem", "pem-kid")
    assert (from_pem.key_id, from_pem.alg) == ("pem-kid", alg)

    jwk = _private_jwk(from_pem.private_key, "jwk-kid")
    (tmp_path / "k.jwk").write_text(json.dumps(jwk))
    from_jwk = load_signing_key(str(tmp_path / "k.jwk"))
    assert from_jwk.key_id == "jwk-kid"  # defaults to the JWK's kid
    assert from_jwk.public_jwk() == {**from_pem.public_jwk(), "kid": "jwk-kid"}
    assert load_signing_key(tmp_path / "k.jwk", "override").key_id == "override"


def test_load_traditional_ec_pem(tmp_path: Path) -> None:
    private_key = ec.generate_private_key(ec.SECP256R1())
    pem = private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )
    assert pem.startswith(b"-----BEGIN EC PRIVATE KEY-----")
    (tmp_path / "k.pem").write_bytes(pem)
    assert load_signing_key(tmp_path / "k.pem", "k").alg == ALG_ES256


def _pem(private_key: object, encryption: serialization.KeySerializationEncryption | None = None) -> bytes:
    return private_key.private_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        encryption or serialization.NoEncryption(),
    )


_ED = Ed25519PrivateKey.generate()
_OTHER_X = SigningKey("o", ALG_ED25519, Ed25519PrivateKey.generate()).public_jwk()["x"]
_BAD_FILES: dict[str, tuple[bytes | None, str | None, str]] = {
    # name: (file content, None for a missing file; key_id; expected message fragment)
    "missing": (None, "k", "cannot read it"),
    "garbage": (b"hunter2-SECRET-not-a-key\n", "k", "not a PEM private key or a private JWK"),
    "truncated-pem": (_pem(_ED)[:60] + b"\n-----END PRIVATE KEY-----\n", "k", "not a PEM private key"),
    "rsa": (_pem(rsa.generate_private_key(65537, 2048)), "k", "unsupported key type RSAPrivateKey"),
    "p384": (_pem(ec.generate_private_key(ec.SECP384R1())), "k", "secp384r1"),
    "encrypted": (_pem(_ED, serialization.BestAvailableEncryption(b"pw")), "k", "encrypted"),
    "pem-without-key-id": (_pem(_ED), None, "OUTBOX_SIGNING_KEY_ID"),
    "jwk-public-only": (json.dumps(SigningKey("k", ALG_ED25519, _ED).public_jwk()).encode(), None, "with 'd'"),
    "jwk-x25519": (json.dumps({"kty": "OKP", "crv": "X25519", "d": "SECRETSECRET"}).encode(), "k", "OKP/X25519"),
    "jwk-bad-d": (json.dumps({"kty": "OKP", "crv": "Ed25519", "d": "SECRET"}).encode(), "k", "not a PEM"),
    "jwk-mismatched-x": (json.dumps({**_private_jwk(_ED, "k"), "x": _OTHER_X}).encode(), None, "do not match"),
    "jwk-without-kid": (json.dumps({**_private_jwk(_ED, "k"), "kid": None}).encode(), None, "no key id"),
    "bad-key-id": (_pem(_ED), "k\u00e9y", "not printable ASCII"),
    "key-id-with-a-space": (_pem(_ED), "k1 ", "begins or ends with a space"),  # published, never matched
    "blank-key-id": (_pem(_ED), " ", "begins or ends with a space"),
}


def _key_material(content: bytes) -> list[str]:
    """What must never be quoted: a JWK's key members, the base64 lines of a PEM, the junk."""
    if content.startswith(b"{"):
        jwk = json.loads(content)
        return [str(jwk[k]) for k in ("d", "x", "y") if k in jwk]
    return [line for line in content.decode().splitlines() if not line.startswith("-----")]


@pytest.mark.parametrize("name", list(_BAD_FILES))
def test_load_errors_are_one_line_and_leak_nothing(name: str, tmp_path: Path) -> None:
    content, key_id, fragment = _BAD_FILES[name]
    path = tmp_path / "key"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigurationError) as err:
        load_signing_key(path, key_id)
    message = str(err.value)
    assert fragment in message and str(path) in message and "\n" not in message
    assert err.value.__cause__ is None and (err.value.__context__ is None or err.value.__suppress_context__)
    for material in _key_material(content or b""):
        assert material[:12] not in message, f"{name}: the message quotes key material"


