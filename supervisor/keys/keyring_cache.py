"""The daemon's copy of the keyring: which key signs each attempt, without a query per attempt.

``CachedKeyring`` polls ``outbox_keyring.version`` every ``REFRESH_SECONDS`` (and at once on
a PostgreSQL NOTIFY), rereads the keys only when it changed, and loads private keys from
their files as soon as they are staged, so a missing or wrong file shows in the log before
anyone promotes it. Picking the key for an attempt is then a lookup in memory at the
database-corrected time (the offset is measured on every poll), so a rotation scheduled in
the database takes effect at the same instant on every replica (see ``supervisor.keys.keyring``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import structlog
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.config import Settings
from outbox.errors import ConfigurationError
from outbox.schema import db_now, keyring
from supervisor.keys.keyring import (
    REFRESH_SECONDS,
    KeyRecord,
    Snapshot,
    bootstrap,
    configured_keys,
    jwks_document,
    read_snapshot,
    revocation_document,
    scope_label,
)
from supervisor.wire.signing import SigningKey, load_signing_key, readable_by_others

JWKS_PATH = "/.well-known/jwks.json"
REVOCATIONS_PATH = "/.well-known/governance-revocations.json"


def load_private_key(record: KeyRecord) -> SigningKey:
    """The private key of ``record`` from its file, checked against the public key published.

    The check is the spec's "assert the public key at init" tripwire: a file replaced under
    the same kid would otherwise sign with a key no buyer can verify.
    """
    key = load_signing_key(record.key_file, record.kid)
    if key.public_members() != dict(record.public_jwk):
        raise ConfigurationError(f"signing key file {record.key_file} no longer holds the key published as "
                                 f"{record.kid!r}: restore it, or revoke {record.kid!r} and stage a new key")
    return key


class CachedKeyring:
    """Implements ``supervisor.wire.signing.KeySource`` for the daemon."""

    def __init__(self, settings: Settings, *, on_scopes: Callable[[dict[str, int]], None] | None = None) -> None:
        self._settings = settings
        self._on_scopes = on_scopes  # told, on every poll, how many keys can sign now in each scope
        self._snapshot: Snapshot | None = None
        self._keys: dict[str, SigningKey] = {}
        self._problems: dict[str, str] = {}
        self._paused: dict[str, str] = {}  # as last logged
        self._offset = 0.0  # database time minus local time
        self._wake = asyncio.Event()
        self._log = structlog.get_logger("outboxd.keyring")

    def now(self) -> float:
        """The database's time, from the local clock and the offset measured at the last poll."""
        return time.time() + self._offset

    @property
    def snapshot(self) -> Snapshot:
        if self._snapshot is None:
            raise ConfigurationError("the keyring has not been read yet")
        return self._snapshot

    async def start(self, engine: AsyncEngine) -> None:
        """Seed the keyring from the configured key files if empty, read it, and fail now
        (not on the first attempt) if no scope can sign."""
        async with engine.begin() as conn:
            registered = await conn.run_sync(lambda c: bootstrap(c, self._settings))
        for record in registered:
            self._log.info("keyring.bootstrapped", kid=record.kid, scope=record.scope, key_file=record.key_file)
        await self.refresh(engine)
        snapshot, now = self.snapshot, self.now()
        for scope, file, kid in configured_keys(self._settings):
            if kid and all(r.kid != kid for r in snapshot.by_scope.get(scope, ())):
                self._log.warning("keyring.config_key_ignored", scope=scope, key_file=file, kid=kid,
                                  hint="the keyring manages this scope: use `outboxd keys rotate`")
        if not snapshot.records:
            raise ConfigurationError("no signing key: set OUTBOX_SIGNING_KEY_FILE (`outboxd keys generate` makes "
                                     "one) or stage and promote one with `outboxd keys rotate`")
        # A scope whose keys were all revoked is paused, not a reason to exit (_install logged it).
        for record in (r for r in (snapshot.active(s, now) for s in snapshot.by_scope) if r is not None):
            if record.kid not in self._keys:
                raise ConfigurationError(self._problems[record.kid])

    def wake(self) -> None:
        """The keyring changed (a NOTIFY): poll now."""
        self._wake.set()

    async def run(self, engine: AsyncEngine, quiet: Callable[[], bool] = lambda: False) -> None:
        """Poll forever; a failed poll keeps the keys already loaded (the claimer reports
        outages). A failure while ``quiet()`` (the daemon cut its connections) is its own
        doing and is not logged."""
        failing = False
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), REFRESH_SECONDS)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.refresh(engine)
                failing = False
            except Exception as exc:
                if not failing and not quiet():
                    self._log.warning("keyring.refresh_failed", error=type(exc).__name__)
                failing = True

    async def refresh(self, engine: AsyncEngine) -> bool:
        """Measure the clock offset and reread the keys if the version moved; True if it did."""
        async with engine.connect() as conn:
            sent = time.time()
            version, db_time = (await conn.execute(select(keyring.c.version, db_now())
                                                   .where(keyring.c.id == 1))).one()
            self._offset = float(db_time) - (sent + time.time()) / 2
            if self._snapshot is not None and self._snapshot.version == version:
                self._log_pauses()
                return False
            snapshot = await conn.run_sync(read_snapshot)
        self._install(snapshot)
        return True

    def _install(self, snapshot: Snapshot) -> None:
        now = self.now()
        for record in snapshot.records:
            may_sign = record.state(now) in ("next", "active")
            if not may_sign:
                self._keys.pop(record.kid, None)
            elif record.kid not in self._keys:
                try:
                    self._keys[record.kid] = load_private_key(record)
                    self._problems.pop(record.kid, None)
                    if readable_by_others(record.key_file):
                        self._log.warning("keyring.key_file_readable_by_others", kid=record.kid, scope=record.scope,
                                          key_file=record.key_file, hint=f"chmod 600 {record.key_file}")
                except ConfigurationError as exc:
                    if self._problems.get(record.kid) != str(exc):
                        self._log.error("keyring.key_unusable", kid=record.kid, scope=record.scope, error=str(exc))
                    self._problems[record.kid] = str(exc)
            if record.activates_at is not None and record.revoked_at is None and (
                    self._snapshot is None or record not in self._snapshot.records):
                self._log.info("keyring.switch", kid=record.kid, scope=record.scope, at=record.activates_at,
                               in_seconds=round(record.activates_at - now, 3))
        self._snapshot = snapshot
        self._log_pauses()

    def paused(self) -> dict[str, str]:
        """Scopes whose deliveries wait for a key now, each with one line saying why and the fix."""
        if self._snapshot is None:
            return {}
        return self._snapshot.paused(self.now())

    def _log_pauses(self) -> None:
        """One log line when a scope's deliveries pause (with the fix), and one when they resume
        (checked on every poll: a promoted key becomes active a second after the change)."""
        paused = self.paused()
        for scope, line in paused.items():
            if scope not in self._paused:
                self._log.error("keyring.scope_paused", scope=scope, detail=line)
        for scope in self._paused.keys() - paused.keys():
            self._log.info("keyring.scope_resumed", scope=scope)
        self._paused = paused
        if self._on_scopes is not None:
            self._on_scopes(self.signing_scopes())

    def signing_scopes(self) -> dict[str, int]:
        """Each scope of the keyring with 1 if a loaded key signs for it now, else 0. A tenant
        whose own first key is only staged is signed for by the default scope, so it reads as
        that scope does (0 there means its webhooks are held)."""
        snapshot = self._snapshot
        if snapshot is None:
            return {}
        now = self.now()

        def signs(scope: str) -> int:
            record = snapshot.active(snapshot.scope_of(scope, now), now)
            return int(record is not None and record.kid in self._keys)

        return {scope: signs(scope) for scope in snapshot.by_scope}

    def resolve(self, tenant_id: str) -> SigningKey:
        """The key that signs for ``tenant_id`` now: its scope's active key."""
        snapshot, now = self.snapshot, self.now()
        scope = snapshot.scope_of(tenant_id, now)
        record = snapshot.active(scope, now)
        if record is None:
            raise ConfigurationError(snapshot.paused(now).get(scope)
                                     or f"{scope_label(scope)} has no active signing key")
        key = self._keys.get(record.kid)
        if key is None:
            raise ConfigurationError(self._problems.get(record.kid, f"key {record.kid!r} is not loaded"))
        return key

    def jwks(self) -> dict[str, Any]:
        return jwks_document(self.snapshot.records, self.now())

    def revocations(self) -> dict[str, Any] | None:
        """The signed revocation list, or ``None`` without OUTBOX_REVOCATION_ISSUER or a signer."""
        snapshot, now = self.snapshot, self.now()
        signer = snapshot.signer(now)
        key = self._keys.get(signer.kid) if signer is not None else None
        if self._settings.revocation_issuer is None or key is None:
            return None
        return revocation_document(snapshot.records, now, issuer=self._settings.revocation_issuer, signer=key)

    def documents(self) -> dict[str, Any]:
        """The paths the daemon's HTTP endpoint serves from the keyring, as JSON bytes (None: 404)."""
        def encode(build: Any) -> Any:
            def document() -> bytes | None:  # None (404) until the keyring is read, e.g. while waiting for the schema
                doc = build() if self._snapshot is not None else None
                return None if doc is None else json.dumps(doc, separators=(",", ":")).encode()
            return document

        return {JWKS_PATH: encode(self.jwks), REVOCATIONS_PATH: encode(self.revocations)}
