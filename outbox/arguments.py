"""Checks of the caller's scalar and mapping arguments, shared by every producer function.

Each returns the value it was given (converted where an ``adcp`` SDK model stands for a
mapping) or raises :class:`~outbox.errors.OutboxValidationError` naming the argument, before
anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from outbox import protocol
from outbox.errors import OutboxValidationError
from outbox.wire import wire_form

__all__ = ["as_mapping", "check_string", "checked_horizon", "is_utf8", "one_of", "optional_string"]


def as_mapping(value: Any, field: str) -> Mapping[str, Any]:
    """``value`` as a mapping (an SDK model as its wire JSON)."""
    value = wire_form(value)
    if not isinstance(value, Mapping):
        raise OutboxValidationError(field, "must be an object (mapping)")
    return value


def check_string(value: Any, field: str, pattern: Any = None, what: str = "") -> str:
    """``value`` if it is non-empty UTF-8 text of at most ``MAX_ID_BYTES`` bytes (matching
    ``pattern``): every index holding identifiers (a report's stream key: tenant, media buy
    and URL) then fits PostgreSQL's bound on an index entry, and a long one is refused here
    on every database instead of failing the seller's transaction on PostgreSQL alone."""
    if not isinstance(value, str) or not value:
        raise OutboxValidationError(field, "is required (a non-empty string)" if value is None else
                                    f"must be a non-empty string, not {type(value).__name__} {str(value)[:40]!r}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        size = -1
    if "\x00" in value or size < 0:
        raise OutboxValidationError(field, "contains a NUL or an unpaired surrogate (not valid UTF-8 text)")
    if size > protocol.MAX_ID_BYTES:
        raise OutboxValidationError(field, f"is over {protocol.MAX_ID_BYTES} bytes of UTF-8")
    if pattern is not None and not pattern.fullmatch(value):
        raise OutboxValidationError(field, f"{value[:80]!r} does not match {what or pattern.pattern}")
    return value


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no unpaired surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def optional_string(value: Any, field: str, pattern: Any = None) -> str | None:
    """:func:`check_string` of a value that may be ``None``."""
    return None if value is None else check_string(value, field, pattern)


def one_of(value: Any, allowed: frozenset[str], field: str, what: str) -> str:
    """``value`` if it is one of ``allowed`` (whatever its type, never a TypeError)."""
    if not isinstance(value, str) or value not in allowed:
        raise OutboxValidationError(field, f"{str(value)[:80]!r} is not {what}")
    return value


def checked_horizon(horizon_seconds: Any) -> int | None:
    """A per-message retry horizon within AdCP's bounds, or ``None`` for the configured one."""
    if horizon_seconds is None:
        return None
    if not isinstance(horizon_seconds, int) or isinstance(horizon_seconds, bool) \
            or not 86_400 <= horizon_seconds <= 604_800:
        raise OutboxValidationError("horizon_seconds",
                                    "must be within 86400..604800 (docs/protocol.md, 'Retry horizon')")
    return horizon_seconds
