"""Stored webhook bodies: opening them, and re-sealing them onto the active key.

A body is stored either as the exact bytes to send or sealed under an encryption key
(:mod:`outbox.sealing`, whose ``plaintext`` is the one way to read what a row sends). Re-sealing moves rows to the active key (and seals
rows written in plaintext, e.g. by a plain-SQL producer) in short batches, so a key
rotation never stops delivery: see docs/encryption.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox.config import Settings
from outbox.identity import binding_digest
from outbox.sealing import CREDENTIAL, SealError, SealingKeys, plaintext, sealed_row
from outbox.schema import messages



def encryption_summary(settings: Settings) -> str:
    """How bodies are stored, in words for the daemon's startup log and ``outboxd status``."""
    keys = settings.sealing()
    if keys is None:
        return "off: webhook bodies (with the buyer's token) are stored in plaintext; set OUTBOX_ENCRYPTION_KEY"
    return f"on: bodies sealed under key {keys.active_id}"


@dataclass(frozen=True)
class SealCounts:
    """How the stored bodies are sealed: the rotation's progress report."""

    plaintext: int
    by_key: dict[str, int]


async def seal_counts(conn: AsyncConnection) -> SealCounts:
    rows = (await conn.execute(select(messages.c.body_key_id, func.count()).group_by(messages.c.body_key_id))).all()
    counts = {kid: int(n) for kid, n in rows}
    return SealCounts(plaintext=counts.pop(None, 0), by_key=counts)


def _not_under(kid: str) -> Any:
    """Rows not sealed under ``kid``, as index ranges (``<>`` would not use the index)."""
    column = messages.c.body_key_id
    return or_(column.is_(None), column < kid, column > kid)


async def reseal_batch(conn: AsyncConnection, keys: SealingKeys, *, after_id: int = 0,
                       limit: int = 200) -> tuple[int, int | None, list[int]]:
    """Re-seal up to ``limit`` rows (id > ``after_id``) not yet under the active key.

    The row's binding digest is recomputed under the new key in the same update. Returns (rows re-sealed, the last id looked at or ``None`` when none is left, ids that
    do not open). The plaintext is the same before and after, so a delivery in flight
    sends identical bytes. Each update is fenced on the key it read, so a concurrent
    re-sealer (another daemon) never overwrites newer work. A row that does not open is
    left alone for the daemon to end ``dead invalid`` when it comes due.
    """
    query = (select(messages.c.id, messages.c.tenant_id, messages.c.idempotency_key, messages.c.body,
                    messages.c.body_key_id, messages.c.auth_secret, messages.c.url, messages.c.auth_mode,
                    messages.c.horizon_seconds, messages.c.notification_type, messages.c.sequence_key)
             .where(and_(messages.c.id > after_id, _not_under(keys.active_id)))
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
