"""Encryption at rest for what the buyer handed the seller: webhook bodies and credentials.

A stored body carries the buyer's ``token`` (and ``context`` the buyer may consider
private); a legacy registration carries an HMAC secret or Bearer token. A database dump,
replica or backup must not hand them out, so both are sealed with AES-256-GCM under the
operator's keys (``OUTBOX_ENCRYPTION_KEY``, older ones in ``OUTBOX_ENCRYPTION_OLD_KEYS``).

Each blob names the key that sealed it (a fingerprint of the key, never the key), so one
active key seals while older keys still open, and a rotation can find what it has left to
re-seal. Each blob is bound by associated data to its row's identity (tenant and
idempotency key) and to its purpose, so a sealed body copied onto another row, or swapped
with the row's sealed credential, does not open. See docs/encryption.md.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
from typing import Any
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

_LEGACY = b"\x01"  # version 1: nonce || ciphertext, credentials only, no key id, AAD = idempotency key
_VERSION = b"\x02"  # version 2: key id || nonce || ciphertext, AAD = purpose, tenant and key
_KEY_ID_BYTES = 8
_NONCE_BYTES = 12
_TAG_BYTES = 16
OVERHEAD = len(_VERSION) + _KEY_ID_BYTES + _NONCE_BYTES + _TAG_BYTES  # sealed size - plaintext size

BODY = b"body"
CREDENTIAL = b"credential"
SUBSCRIBER_CREDENTIAL = b"subscriber-credential"  # bound to (tenant, [account, subscriber])


class SealError(ValueError):
    """A sealed value that cannot be opened (unknown key, tampered, or moved from another row)."""


class KeyUnavailable(SealError):
    """A sealed value under a key this process does not have: the row is fine, the process is
    not (a key missing from its configuration). It waits for a process that has the key,
    never ends dead (docs/encryption.md, "Without the key")."""


def key_id(key: bytes) -> str:
    """The public name of a key: a fingerprint that identifies it without revealing it."""
    return hashlib.sha256(b"outboxd sealing key id\x00" + key).digest()[:_KEY_ID_BYTES].hex()


def _associated(purpose: bytes, tenant_id: str, idempotency_key: str) -> bytes:
    return b"\x00".join((b"outboxd", purpose, tenant_id.encode(), idempotency_key.encode()))


def sealed_key_id(blob: bytes) -> str | None:
    """The id of the key that sealed ``blob`` (``None`` for a version-1 credential blob)."""
    if blob[:1] == _VERSION and len(blob) >= OVERHEAD:
        return blob[1 : 1 + _KEY_ID_BYTES].hex()
    return None


@dataclass(frozen=True)
class SealingKeys:
    """The active key (seals) and every key that may still open (the active one included)."""

    active: bytes
    older: tuple[bytes, ...] = ()
    _by_id: dict[str, AESGCM] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        keys = {key_id(k): AESGCM(k) for k in (*self.older, self.active)}
        object.__setattr__(self, "_by_id", keys)

    @property
    def active_id(self) -> str:
        return key_id(self.active)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(self._by_id)

    def can_open(self, kid: str | None) -> bool:
        """Whether a value sealed under ``kid`` (``None``: plaintext) opens here."""
        return kid is None or kid in self._by_id

    def sealing_under(self, kid: str) -> "SealingKeys":
        """These keys, sealing under ``kid`` (one of them) instead of the configured active key."""
        if kid == self.active_id:
            return self
        chosen = self._raw(kid)
        keys = sealing_keys(chosen, tuple(k for k in (*self.older, self.active) if k != chosen))
        assert keys is not None  # an active key was given
        return keys

    def seal(self, purpose: bytes, plaintext: bytes, *, tenant_id: str, idempotency_key: str) -> bytes:
        """Seal under the active key with a fresh random nonce, bound to the row and purpose."""
        nonce = os.urandom(_NONCE_BYTES)
        aad = _associated(purpose, tenant_id, idempotency_key)
        sealed = self._by_id[self.active_id].encrypt(nonce, plaintext, aad)
        return _VERSION + bytes.fromhex(self.active_id) + nonce + sealed

    def open(self, purpose: bytes, blob: bytes, *, tenant_id: str, idempotency_key: str) -> bytes:
        """The plaintext of ``blob``, or :class:`SealError` saying exactly why it does not open."""
        if blob[:1] == _LEGACY:
            return self._open_legacy(blob, idempotency_key)
        kid = sealed_key_id(blob)
        if kid is None:
            raise SealError("sealed value has an unknown format")
        cipher = self._by_id.get(kid)
        if cipher is None:
            raise KeyUnavailable(f"sealed under key {kid}, which is neither OUTBOX_ENCRYPTION_KEY nor one of "
                                 "OUTBOX_ENCRYPTION_OLD_KEYS here: add it (docs/encryption.md)")
        nonce = blob[1 + _KEY_ID_BYTES : 1 + _KEY_ID_BYTES + _NONCE_BYTES]
        try:
            return cipher.decrypt(nonce, blob[1 + _KEY_ID_BYTES + _NONCE_BYTES :],
                                  _associated(purpose, tenant_id, idempotency_key))
        except InvalidTag:
            raise SealError(f"sealed value does not open under key {kid}: tampered, or moved from another row") \
                from None

    def _open_legacy(self, blob: bytes, idempotency_key: str) -> bytes:
        """Credentials sealed before blobs named their key: try each key (there are few)."""
        nonce, ciphertext = blob[1 : 1 + _NONCE_BYTES], blob[1 + _NONCE_BYTES :]
        for cipher in self._by_id.values():
            try:
                return cipher.decrypt(nonce, ciphertext, idempotency_key.encode())
            except InvalidTag:
                continue
        raise KeyUnavailable("sealed credential does not open with any configured encryption key")

    def digest(self, data: bytes, kid: str | None = None) -> bytes:
        """A keyed digest (HMAC-SHA256) of ``data`` under key ``kid`` (default: the active key).

        Lets the producer compare a retried payload with a sealed one without opening it,
        and without storing a plain hash from which a guessed token could be confirmed.
        """
        key = self.active if kid is None else self._raw(kid)
        return hmac.new(hashlib.sha256(b"outboxd binding digest\x00" + key).digest(), data, hashlib.sha256).digest()

    def _raw(self, kid: str) -> bytes:
        for key in (*self.older, self.active):
            if key_id(key) == kid:
                return key
        raise KeyUnavailable(f"key {kid} is not configured")


@functools.lru_cache(maxsize=8)
def sealing_keys(active: bytes | None, older: tuple[bytes, ...] = ()) -> SealingKeys | None:
    """The keyring the settings describe, or ``None`` when nothing is sealed (no active key).

    Cached: building the ciphers costs more than sealing a small body.
    """
    return None if active is None else SealingKeys(active, older)


def sealed_row(keys: SealingKeys | None, *, tenant_id: str, idempotency_key: str, body: bytes,
               credentials: str | None, seal_body: bool = True) -> dict[str, Any]:
    """The stored columns of a body and its legacy credential: sealed when a key is configured.

    One function for the producer and for the re-sealing of existing rows, so both store
    exactly the same shape. ``body_sha256`` covers the stored bytes, never the plaintext.
    ``seal_body=False`` (a schema without ``body_key_id``) seals only the credential.
    """
    secret = None
    if credentials is not None:
        assert keys is not None  # enqueue refuses credentials without a key
        secret = keys.seal(CREDENTIAL, credentials.encode(), tenant_id=tenant_id, idempotency_key=idempotency_key)
    if keys is None or not seal_body:  # no body_key_id written: as a release without sealing writes it
        return {"body": body, "body_sha256": hashlib.sha256(body).digest(), "auth_secret": secret}
    stored = keys.seal(BODY, body, tenant_id=tenant_id, idempotency_key=idempotency_key)
    return {"body": stored, "body_sha256": hashlib.sha256(stored).digest(), "body_key_id": keys.active_id,
            "auth_secret": secret}


def plaintext(row: Any, keys: SealingKeys | None) -> bytes:
    """The exact bytes a stored row (``body``, ``body_key_id``, ``tenant_id``,
    ``idempotency_key`` attributes) sends: its body, opened when sealed (else :class:`SealError`).

    The one way to read what a row sends: the daemon before signing, the idempotency check
    on a sealed twin, ``outboxd show`` and the console before masking.
    """
    if row.body_key_id is None:
        return bytes(row.body)
    if keys is None:
        raise KeyUnavailable(f"body is sealed under key {row.body_key_id} but OUTBOX_ENCRYPTION_KEY is not set: "
                             "set it (docs/encryption.md)")
    return keys.open(BODY, bytes(row.body), tenant_id=row.tenant_id, idempotency_key=row.idempotency_key)
