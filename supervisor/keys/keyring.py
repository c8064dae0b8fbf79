"""The signing keyring: every scope's keys, their lifecycle, and the documents buyers fetch.

A scope is the default ("") or a tenant that signs with its own keys. Each key is, at any
instant, ``next`` (published, not signing), ``active`` (signs; one per scope), ``retiring``
(published, not signing), ``retired`` (gone from the JWKS) or ``revoked`` (gone from the
JWKS, listed in ``revoked_kids``). The state is not stored but derived from the key's times
in ``outbox_signing_keys``, all taken from the database clock, so every replica that has
read the same rows agrees on which key signs at any instant. A promotion is scheduled
``SWITCH_DELAY_SECONDS`` ahead, longer than a daemon takes to see it (``REFRESH_SECONDS``,
or a NOTIFY on PostgreSQL): all replicas switch at the same moment. Private keys stay in
files or mounted secrets; the database holds only their path and public half.

The waits follow https://adcontextprotocol.org/docs/building/by-layer/L1/security
("Webhook callbacks", "Transport revocation"): buyers cache the JWKS for up to
``key_cache_window_seconds`` and refetch on an unknown ``kid`` at most every 30 s, so a key
signs only after it has been published that long, and a retired key stays published for
the signature validity, the verifier's 60 s skew and the cache window after its last
signature. Every change bumps ``outbox_keyring.version``, the one integer daemons poll.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping
import os
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from functools import cached_property
from typing import Any

from sqlalchemy import Connection, select, text, update

from outbox.config import Settings
from outbox.schema import db_now, keyring, signing_keys
from supervisor.wire.signing import (
    ADCP_USE_REQUEST,
    ADCP_USE_WEBHOOK,
    DEFAULT_ADCP_USE,
    MAX_VALIDITY_SECONDS,
    SigningKey,
    load_signing_key,
)

__all__ = [
    "ADCP_USE_REQUEST",
    "ADCP_USE_WEBHOOK",
    "CHANNEL",
    "DEFAULT_SCOPE",
    "KeyRecord",
    "KeyringError",
    "Promotion",
    "Snapshot",
    "bootstrap",
    "jwks_document",
    "promote",
    "read_snapshot",
    "revocation_document",
    "revoke",
    "stage",
]

DEFAULT_SCOPE = ""
CHANNEL = "outbox_keyring"  # PostgreSQL NOTIFY channel of keyring changes
SWITCH_DELAY_SECONDS = 1.0  # a promotion takes effect this long after it commits
REFRESH_SECONDS = 0.25  # how often a daemon polls the keyring version
VERIFIER_SKEW_SECONDS = 60  # verifiers accept a signature until expires + 60 s
REVOCATION_TYP = "adcp-gov-revocation+jws"
REVOCATION_INTERVAL_SECONDS = 300  # next_update cadence; the spec allows 60 s .. 30 min
_JWS_ALG = {"ed25519": "EdDSA", "ecdsa-p256-sha256": "ES256"}


class KeyringError(ValueError):
    """A keyring change refused (unknown kid, a promotion too early, ...): one line."""


def scope_label(scope: str) -> str:
    return "the default scope" if scope == DEFAULT_SCOPE else f"tenant {scope!r}"


def iso(epoch: float) -> str:
    return datetime.fromtimestamp(int(epoch), timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class KeyRecord:
    """One key of the keyring: where its private half lives, its public JWK, its times."""

    kid: str
    scope: str
    alg: str
    key_file: str
    public_jwk: Mapping[str, Any]  # without adcp_use
    adcp_use: str
    published_at: float
    activates_at: float | None = None
    deactivates_at: float | None = None
    unpublish_at: float | None = None
    revoked_at: float | None = None

    def state(self, now: float) -> str:
        if self.revoked_at is not None and self.revoked_at <= now:
            return "revoked"
        if self.activates_at is None or now < self.activates_at:
            return "next"
        if self.deactivates_at is None or now < self.deactivates_at:
            return "active"
        if self.unpublish_at is None or now < self.unpublish_at:
            return "retiring"
        return "retired"

    def published(self, now: float) -> bool:
        return self.state(now) in ("next", "active", "retiring")

    def jwk(self) -> dict[str, Any]:
        """The public JWK buyers fetch (security page, "Key publication")."""
        return {**self.public_jwk, "adcp_use": self.adcp_use}

    def as_dict(self, now: float) -> dict[str, Any]:
        return {"kid": self.kid, "scope": self.scope, "state": self.state(now), "alg": self.alg,
                "adcp_use": self.adcp_use, "key_file": self.key_file, "published_at": self.published_at,
                "activates_at": self.activates_at, "deactivates_at": self.deactivates_at,
                "unpublish_at": self.unpublish_at, "revoked_at": self.revoked_at}


@dataclass(frozen=True)
class Snapshot:
    """The keyring as read at ``now`` (database time), tagged with its ``version``."""

    version: int
    now: float
    records: tuple[KeyRecord, ...]

    @cached_property
    def by_scope(self) -> dict[str, tuple[KeyRecord, ...]]:
        scopes: dict[str, list[KeyRecord]] = {}
        for record in self.records:
            scopes.setdefault(record.scope, []).append(record)
        return {scope: tuple(records) for scope, records in scopes.items()}

    @cached_property
    def own_since(self) -> dict[str, float]:
        """When each scope's first key became active (a promotion cancelled by revocation aside)."""
        since: dict[str, float] = {}
        for r in self.records:
            if r.activates_at is not None and (r.revoked_at is None or r.revoked_at > r.activates_at):
                since[r.scope] = min(since.get(r.scope, r.activates_at), r.activates_at)
        return since

    def scope_of(self, tenant_id: str, now: float) -> str:
        """The scope that signs for ``tenant_id``: its own once it has had an active key, for
        good (a tenant whose keys are all revoked waits, it never falls back to the default)."""
        return tenant_id if self.own_since.get(tenant_id, float("inf")) <= now else DEFAULT_SCOPE

    def active(self, scope: str, now: float) -> KeyRecord | None:
        return next((r for r in self.by_scope.get(scope, ()) if r.state(now) == "active"), None)

    def paused(self, now: float) -> dict[str, str]:
        """The scopes that sign for someone but have no active key at ``now`` (all revoked, or
        retired with none promoted), each with the one line that says so and what to do.

        Their deliveries wait, unsent and uncounted (``supervisor.cycle.attempt``), until a key is
        promoted: a missing key is the seller's to fix, never the buyer's attempt to burn.
        """
        lines = {}
        for scope, records in self.by_scope.items():
            if self.active(scope, now) is not None or (scope != DEFAULT_SCOPE and
                                                       self.own_since.get(scope, float("inf")) > now):
                continue
            flag = tenant_flag(scope)
            fix = (f"`outboxd keys promote{flag}`" if any(r.state(now) == "next" for r in records) else
                   f"`outboxd keys rotate{flag} --generate FILE`, then `outboxd keys promote{flag}`")
            lines[scope] = (f"{scope_label(scope)} has no active signing key: its deliveries are paused "
                            f"(held, no attempt made) until one is promoted: {fix}")
        return lines

    def signer(self, now: float) -> KeyRecord | None:
        """The key that signs operator documents (the revocation list): a published key, the
        default scope's active one if there is one (a revoked or retiring key never signs)."""
        candidates = [r for r in self.records if r.state(now) in ("active", "next")]
        return min(candidates, key=lambda r: (r.state(now) != "active", r.scope, r.published_at), default=None)


def jwks_document(records: Iterable[KeyRecord], now: float) -> dict[str, Any]:
    """The JWKS to serve at the seller's ``jwks_uri``: every scope's published keys at ``now``.

    The one builder of this document: the daemon's ``/.well-known/jwks.json``, ``outboxd keys
    jwks`` and a seller's own agent (``jwks_document(snapshot.records, snapshot.now)`` after
    ``read_snapshot(conn)``) all serve the same bytes for the same keyring and instant.
    """
    published = sorted((r for r in records if r.published(now)), key=lambda r: (r.scope, r.published_at, r.kid))
    return {"keys": [r.jwk() for r in published]}


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def revocation_document(records: Iterable[KeyRecord], now: float, *, issuer: str,
                        signer: SigningKey) -> dict[str, Any]:
    """The signed revocation list (security page, "Transport revocation") as a JWS, JSON form.

    ``revoked_kids`` lists every revoked key of every scope; ``signer`` must be a key the
    JWKS publishes (``Snapshot.signer``). Served at ``/.well-known/governance-revocations.json``.
    """
    payload = {
        "version": 1,
        "issuer": issuer,
        "updated": iso(now),
        "next_update": iso(now + REVOCATION_INTERVAL_SECONDS),
        "revoked_kids": sorted(r.kid for r in records if r.revoked_at is not None and r.revoked_at <= now),
        "revoked_jtis": [],
    }
    header = {"alg": _JWS_ALG[signer.alg], "kid": signer.key_id, "typ": REVOCATION_TYP}
    protected = _b64url(json.dumps(header, separators=(",", ":")).encode())
    body = _b64url(json.dumps(payload, separators=(",", ":")).encode())
    signature = signer.sign(f"{protected}.{body}".encode("ascii"))
    return {"payload": body, "signatures": [{"protected": protected, "signature": _b64url(signature)}]}


# --------------------------------------------------------------------------- database


def _record(row: Any) -> KeyRecord:
    values = dict(row._mapping)
    values["public_jwk"] = json.loads(values["public_jwk"])
    return KeyRecord(**values)


def read_snapshot(conn: Connection) -> Snapshot:
    """The whole keyring and the database time (async callers: ``await conn.run_sync(read_snapshot)``)."""
    version, now = conn.execute(select(keyring.c.version, db_now()).where(keyring.c.id == 1)).one()
    records = tuple(_record(row) for row in conn.execute(select(signing_keys).order_by(signing_keys.c.kid)))
    return Snapshot(int(version), float(now), records)


def _lock(conn: Connection) -> Snapshot:
    """Serialize keyring writers (the version row's lock; SQLite writes are serial anyway),
    tell daemons, and return the keyring as it is now."""
    conn.execute(update(keyring).where(keyring.c.id == 1).values(version=keyring.c.version + 1))
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_notify(:channel, '')"), {"channel": CHANNEL})
    return read_snapshot(conn)


def _insert(conn: Connection, snapshot: Snapshot, *, scope: str, key: SigningKey, key_file: str,
            adcp_use: str, active: bool) -> KeyRecord:
    for record in snapshot.records:
        if record.kid == key.key_id:
            raise KeyringError(f"key id {key.key_id!r} is already in the keyring ({scope_label(record.scope)}); "
                               "every kid must be unique in the JWKS")
        if record.public_jwk.get("x") == key.public_members().get("x"):
            raise KeyringError(f"{key_file} holds a key already in the keyring as {record.kid!r}")
    if adcp_use not in (ADCP_USE_REQUEST, ADCP_USE_WEBHOOK):
        raise KeyringError(f"adcp_use must be {ADCP_USE_REQUEST!r} or {ADCP_USE_WEBHOOK!r}, got {adcp_use!r}")
    record = KeyRecord(kid=key.key_id, scope=scope, alg=key.alg, key_file=key_file,
                       public_jwk=key.public_members(), adcp_use=adcp_use, published_at=snapshot.now,
                       activates_at=snapshot.now if active else None)
    values = {**asdict(record), "public_jwk": json.dumps(record.public_jwk)}
    conn.execute(signing_keys.insert().values(**values))
    return record


def configured_keys(settings: Settings) -> list[tuple[str, str, str | None]]:
    """``(scope, key file, key id)`` of the single-file configuration: the keyring's seed."""
    seeds: list[tuple[str, str, str | None]] = []
    if settings.signing_key_file:
        seeds.append((DEFAULT_SCOPE, settings.signing_key_file, settings.signing_key_id))
    seeds += [(tenant, file, kid) for tenant, (file, kid) in settings.tenant_signing_keys.items()]
    return seeds


def unseeded(snapshot: Snapshot, seeds: list[tuple[str, str, str | None]]) -> bool:
    """Whether a scope of ``seeds`` (:func:`configured_keys`) has no key yet, so
    :func:`bootstrap` has one to register."""
    return any(not snapshot.by_scope.get(scope) for scope, _, _ in seeds)


def bootstrap(conn: Connection, settings: Settings) -> list[KeyRecord]:
    """Register each configured key (``OUTBOX_SIGNING_KEY_FILE``, ``tenant_signing_keys``) as
    its scope's active key if that scope has no key yet; return what was registered.

    A scope with keys is left alone: from then on ``outboxd keys`` manages it. Safe to run
    from every replica at once: writers are serialized and the check is repeated under lock.
    """
    seeds = configured_keys(settings)
    if not unseeded(read_snapshot(conn), seeds):
        return []
    snapshot = _lock(conn)
    registered = []
    for scope, file, kid in seeds:
        if not snapshot.by_scope.get(scope):
            key = load_signing_key(file, kid)
            registered.append(_insert(conn, snapshot, scope=scope, key=key, key_file=os.path.abspath(file),
                                      adcp_use=DEFAULT_ADCP_USE, active=True))
            snapshot = read_snapshot(conn)
    return registered


def stage(conn: Connection, *, scope: str, key: SigningKey, key_file: str,
          adcp_use: str = DEFAULT_ADCP_USE) -> KeyRecord:
    """Add ``key`` to ``scope`` as ``next``: published from now on, signing nothing yet."""
    return _insert(conn, _lock(conn), scope=scope, key=key, key_file=key_file, adcp_use=adcp_use, active=False)


@dataclass(frozen=True)
class Promotion:
    new: KeyRecord
    old: KeyRecord | None
    switch_at: float
    forced_early: bool  # promoted with --force before the cache window had passed


def tenant_flag(scope: str) -> str:
    """The ``--tenant`` option that names ``scope`` on an ``outboxd keys`` command line."""
    return "" if scope == DEFAULT_SCOPE else f" --tenant {scope}"


def _next_key(snapshot: Snapshot, scope: str, kid: str | None) -> KeyRecord:
    if kid is not None:
        found = next((r for r in snapshot.records if r.kid == kid), None)
        if found is None:
            raise KeyringError(f"no key {kid!r} in the keyring (see `outboxd keys list`)")
        if found.scope != scope:  # a kid never moves a scope other than the one named
            raise KeyringError(f"key {kid!r} belongs to {scope_label(found.scope)}, not {scope_label(scope)}: "
                               f"`outboxd keys promote{tenant_flag(found.scope)} {kid}`")
        if found.state(snapshot.now) != "next":
            raise KeyringError(f"key {kid!r} is {found.state(snapshot.now)}, only a next key can be promoted")
        return found
    candidates = [r for r in snapshot.by_scope.get(scope, ()) if r.state(snapshot.now) == "next"
                  and r.activates_at is None]
    if len(candidates) != 1:
        raise KeyringError(f"{scope_label(scope)} has no next key: stage one with `outboxd keys rotate`"
                           if not candidates else
                           f"{scope_label(scope)} has several next keys; name one: "
                           + ", ".join(r.kid for r in candidates))
    return candidates[0]


def promote(conn: Connection, *, scope: str = DEFAULT_SCOPE, kid: str | None = None,
            cache_window: float, force: bool = False) -> Promotion:
    """Make the scope's next key active ``SWITCH_DELAY_SECONDS`` from now; the active one retires.

    Refused (``KeyringError``) until the key has been published for ``cache_window``
    seconds, since a buyer whose cached JWKS predates it would reject every webhook it
    signs (``webhook_signature_key_unknown``, terminal); ``force`` promotes anyway.
    """
    snapshot = _lock(conn)
    new = _next_key(snapshot, scope, kid)
    now, scope = snapshot.now, new.scope
    if any(r.activates_at is not None and r.activates_at > now and r.revoked_at is None
           for r in snapshot.by_scope[scope]):
        raise KeyringError(f"{scope_label(scope)} already has a switch scheduled; run again in a second")
    ready_at = new.published_at + cache_window
    if now < ready_at and not force:
        raise KeyringError(
            f"key {new.kid!r} has been published for {now - new.published_at:.0f} s; buyers may cache the "
            f"JWKS for {cache_window:.0f} s (OUTBOX_KEY_CACHE_WINDOW_SECONDS), so promote it after "
            f"{iso(ready_at)} (in {ready_at - now:.0f} s) or pass --force")
    switch_at = now + SWITCH_DELAY_SECONDS
    old = snapshot.active(scope, now)
    new = _update(conn, new, activates_at=switch_at)
    if old is not None:
        old = _update(conn, old, deactivates_at=switch_at,
                      unpublish_at=switch_at + MAX_VALIDITY_SECONDS + VERIFIER_SKEW_SECONDS + cache_window)
    return Promotion(new, old, switch_at, forced_early=now < ready_at)


def _update(conn: Connection, record: KeyRecord, **times: Any) -> KeyRecord:
    conn.execute(update(signing_keys).where(signing_keys.c.kid == record.kid).values(**times))
    return replace(record, **times)


def revoke(conn: Connection, kid: str) -> KeyRecord:
    """Stop signing with and publishing ``kid`` now, and list it in ``revoked_kids``.

    Revoking the active key leaves its scope without one: its deliveries wait, unsent and
    with no attempt counted (``Snapshot.paused``), until a next key is promoted. Revoking a
    key whose promotion is still pending cancels that switch, so the current key keeps signing.
    """
    snapshot = _lock(conn)
    record = next((r for r in snapshot.records if r.kid == kid), None)
    if record is None:
        raise KeyringError(f"no key {kid!r} in the keyring (see `outboxd keys list`)")
    if record.revoked_at is not None:
        raise KeyringError(f"key {kid!r} is already revoked (since {iso(record.revoked_at)})")
    now = snapshot.now
    if record.activates_at is not None and record.activates_at > now:
        for other in snapshot.by_scope[record.scope]:
            if other.deactivates_at == record.activates_at:
                _update(conn, other, deactivates_at=None, unpublish_at=None)
    return _update(conn, record, revoked_at=now)
