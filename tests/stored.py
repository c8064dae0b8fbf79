"""Reading what the outbox stored, as the daemon would: bodies opened when sealed."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from outbox.sealing import plaintext
from outbox.config import Settings
from outbox.schema import messages


def row(engine: Any, message_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(messages).where(messages.c.id == message_id)).one()


def body(engine: Any, message_id: int, settings: Settings) -> bytes:
    """The exact bytes message ``message_id`` sends."""
    return plaintext(row(engine, message_id), settings.sealing())
