"""Stored webhook bodies: opening them, and re-sealing them onto the active key.

A body is stored either as the exact bytes to send or sealed under an encryption key
(:mod:`outbox.sealing`, whose ``plaintext`` is the one way to read what a row sends).
Re-sealing moves rows to the active key (and seals rows written in plaintext, e.g. by a
plain-SQL producer) in short batches, so a key rotation never stops delivery: see
docs/encryption.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox.config import Settings
from outbox.identity import binding_digest
from outbox.sealing import CREDENTIAL, SUBSCRIBER_CREDENTIAL, SealError, SealingKeys, plaintext, sealed_key_id, \
    sealed_row
from outbox.schema import messages, subscribers
from outbox.subscribers import credential_identity



def encryption_summary(settings: Settings, sealing_key_id: str | None = None) -> str:
    """How bodies are stored, in words for the daemon's startup log and ``outboxd status``."""
    keys = settings.sealing()
    if keys is None:
        return "off: webhook bodies (with the buyer's token) are stored in plaintext; set OUTBOX_ENCRYPTION_KEY"
    if sealing_key_id is not None and sealing_key_id != keys.active_id:
        opens = "opens it" if keys.can_open(sealing_key_id) else "does NOT have it: add it"
        return f"on: bodies sealed under the agreed key {sealing_key_id} (this configuration {opens})"
    return f"on: bodies sealed under key {keys.active_id}"


# The sealed values, by table: (what the operator reads, the table).
MESSAGE_BODIES = "message bodies"
MESSAGE_CREDENTIALS = "message credentials"
SUBSCRIBER_CREDENTIALS = "subscriber credentials"


def _outside(column: Any, kids: Sequence[str]) -> Any:
    """Sealed values under none of ``kids``, as index ranges (``NOT IN`` would not use the index)."""
    bounds = sorted(set(kids))
    if not bounds:
        return column.is_not(None)
    ranges = [column < bounds[0], column > bounds[-1]]
    ranges += [and_(column > low, column < high) for low, high in zip(bounds, bounds[1:])]
    return or_(*ranges)


def not_under(kid: str) -> Any:
    """Rows not sealed under ``kid``: plaintext ones, and sealed under another key."""
    return or_(messages.c.body_key_id.is_(None), _outside(messages.c.body_key_id, [kid]))


def _blob_key(blob: bytes | None) -> str | None:
    """The key id of a sealed credential ("legacy" for one sealed before blobs named their key)."""
    return None if blob is None else (sealed_key_id(bytes(blob)) or "legacy")


async def sealed_counts(conn: AsyncConnection) -> dict[str, dict[str | None, int]]:
    """Rows per key (``None``: plaintext) of every table holding sealed values: the
    rotation's progress, and what a key removal would strand.

    Credentials are counted from their blobs (a table scan of the rows that have one):
    an operator's command, not a loop.
    """
    counts: dict[str, dict[str | None, int]] = {}
    rows = (await conn.execute(select(messages.c.body_key_id, func.count()).group_by(messages.c.body_key_id))).all()
    counts[MESSAGE_BODIES] = {kid: int(n) for kid, n in rows}
    for name, table in ((MESSAGE_CREDENTIALS, messages), (SUBSCRIBER_CREDENTIALS, subscribers)):
        tally: dict[str | None, int] = {}
        for (blob,) in await conn.execute(select(table.c.auth_secret).where(table.c.auth_secret.is_not(None))):
            kid = _blob_key(blob)
            tally[kid] = tally.get(kid, 0) + 1
        counts[name] = tally
    return counts


async def unopenable_rows(conn: AsyncConnection, keys: SealingKeys | None) -> int:
    """Messages still to deliver whose body is sealed under a key ``keys`` lacks: what this
    process would hold (``outbox_sealed_rows_unopenable``)."""
    kids = [] if keys is None else list(keys.ids)
    query = (select(func.count()).select_from(messages)
             .where(messages.c.state.in_(("pending", "in_flight")), _outside(messages.c.body_key_id, kids)))
    return int((await conn.execute(query)).scalar_one())


async def reseal_batch(conn: AsyncConnection, keys: SealingKeys, *, after_id: int = 0,
                       limit: int = 200) -> tuple[int, int | None, list[int]]:
    """Re-seal up to ``limit`` rows (id > ``after_id``) not yet under the active key.

    The row's binding digest is recomputed under the new key in the same update. Returns
    (rows re-sealed, the last id looked at or ``None`` when none is left, ids that do not
    open). The plaintext is the same before and after, so a delivery in flight sends
    identical bytes. Each update is fenced on the key it read, so a concurrent re-sealer
    (another daemon) never overwrites newer work. A row that does not open is left alone: a
    process that has its key moves it.
    """
    query = (select(messages.c.id, messages.c.tenant_id, messages.c.idempotency_key, messages.c.body,
                    messages.c.body_key_id, messages.c.auth_secret, messages.c.url, messages.c.auth_mode,
                    messages.c.horizon_seconds, messages.c.notification_type, messages.c.sequence_key)
             .where(and_(messages.c.id > after_id, not_under(keys.active_id)))
             .order_by(messages.c.id).limit(limit))
    if conn.dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True)
    rows = (await conn.execute(query)).all()
    done, failed = 0, []
    for row in rows:
        try:
            body = plaintext(row, keys)
            credential = None if row.auth_secret is None else keys.open(
                CREDENTIAL, bytes(row.auth_secret), tenant_id=row.tenant_id, idempotency_key=row.idempotency_key)
        except SealError:
            failed.append(row.id)
            continue
        values = sealed_row(keys, tenant_id=row.tenant_id, idempotency_key=row.idempotency_key, body=body,
                            credentials=None if credential is None else credential.decode())
        if row.auth_secret is None:
            values.pop("auth_secret")
        # The binding digest moves to the new key too (and a plain-SQL row gets its first).
        values["binding_digest"] = binding_digest({**row._mapping, **values, "body": body}, keys)
        fence = messages.c.body_key_id.is_(None) if row.body_key_id is None else \
            messages.c.body_key_id == row.body_key_id
        result = await conn.execute(update(messages).where(and_(messages.c.id == row.id, fence)).values(**values))
        done += result.rowcount
    return done, (rows[-1].id if rows else None), failed


async def reseal_subscribers(conn: AsyncConnection, keys: SealingKeys) -> tuple[int, list[int]]:
    """Re-seal every subscriber credential not under the active key: (count, ids that do not open).

    Subscribers are few (one per buyer channel), so one pass reads them all. Each update is
    fenced on the blob it read, like the message re-sealer's.
    """
    rows = (await conn.execute(select(subscribers.c.id, subscribers.c.tenant_id, subscribers.c.account_id,
                                      subscribers.c.subscriber_id, subscribers.c.auth_secret)
                               .where(subscribers.c.auth_secret.is_not(None)).order_by(subscribers.c.id))).all()
    done, failed = 0, []
    for row in rows:
        blob = bytes(row.auth_secret)
        if _blob_key(blob) == keys.active_id:
            continue
        identity = credential_identity(row.account_id, row.subscriber_id)
        try:
            credential = keys.open(SUBSCRIBER_CREDENTIAL, blob, tenant_id=row.tenant_id, idempotency_key=identity)
        except SealError:
            failed.append(row.id)
            continue
        sealed = keys.seal(SUBSCRIBER_CREDENTIAL, credential, tenant_id=row.tenant_id, idempotency_key=identity)
        result = await conn.execute(update(subscribers).where(subscribers.c.id == row.id,
                                                              subscribers.c.auth_secret == blob)
                                    .values(auth_secret=sealed))
        done += result.rowcount
    return done, failed
