"""Encryption at rest for the buyer's legacy webhook credentials (docs/protocol.md "Legacy credentials").

HMAC secrets and Bearer tokens are the buyer's credentials: a database dump must not leak
them. They are sealed with AES-256-GCM under the operator's ``OUTBOX_ENCRYPTION_KEY`` and
bound to the message's idempotency key as associated data, so a sealed blob copied onto
another row does not open.
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

_VERSION = b"\x01"
_NONCE_BYTES = 12


class SealError(ValueError):
    """A sealed credential that cannot be opened (wrong key, tampered, or not ours)."""


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    nonce = os.urandom(_NONCE_BYTES)
    return _VERSION + nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def unseal(key: bytes, blob: bytes, associated: bytes) -> bytes:
    if len(blob) < 1 + _NONCE_BYTES + 16 or blob[:1] != _VERSION:
        raise SealError("sealed credential has an unknown format")
    nonce, ciphertext = blob[1 : 1 + _NONCE_BYTES], blob[1 + _NONCE_BYTES :]
    try:
        return AESGCM(key).decrypt(nonce, ciphertext, associated)
    except InvalidTag:
        raise SealError("sealed credential does not open with the configured OUTBOX_ENCRYPTION_KEY") from None
