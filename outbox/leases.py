"""What the claim hands the daemon and what the daemon hands back: a leased message
(:class:`Claimed`), one claim's batch of them (:class:`ClaimedBatch`), the recorded
outcome of one (:class:`Completion`) and a lease taken back from a daemon that died
(:class:`RescuedLease`). Kept apart from the statements (outbox/store.py) because
every part of the delivery cycle passes them around, and none of it needs the SQL.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["Claimed", "ClaimedBatch", "Completion", "RescuedLease"]


@dataclass(frozen=True)
class Claimed:
    """A leased message: everything one attempt needs, and the fence to record it with."""

    id: int
    tenant_id: str
    url: str
    origin: str | None
    idempotency_key: str
    body: bytes
    body_sha256: bytes | None
    auth_mode: str
    auth_secret: bytes | None
    sequence_number: int | None
    notification_type: str | None
    attempt: int
    retry_until: float
    created_at: float
    trigger: str
    claimed_at: float
    lease_token: str
    stored_origin: str | None = None  # the origin column as read; the completion fixes it if it differs
    breaker_state: str | None = None  # this endpoint's breaker at claim time (None: no row)
    breaker_open_until: float | None = None
    body_key_id: str | None = None  # the key the stored body is sealed under (None: plaintext)
    # time.monotonic() when the claim statement was sent: its lease and ``claimed_at`` are no
    # older than this, whatever the round trip (or, on SQLite, the wait for the write lock) took.
    claim_sent: float = field(default_factory=time.monotonic)
    traceparent: str | None = None  # the enqueuing caller's W3C trace context
    subscriber_ref: int | None = None  # the subscriber of an account-level fire (its revocation stops retries)
    holds_probe: bool = False  # this daemon took its endpoint's half-open probe for it: returned if not sent

    def db_time(self) -> float:
        """The database's time now, from the claim's: ``claimed_at`` plus the monotonic time
        since the claim was sent (docs/architecture.md "Time comes from the database").

        Never earlier than the truth (the statement read its clock after it was sent), so a
        horizon judged with it is never overrun; late by at most the claim's round trip.
        """
        return self.claimed_at + (time.monotonic() - self.claim_sent)


@dataclass(frozen=True)
class Completion:
    """The recorded outcome of one leased message."""

    message_id: int
    lease_token: str
    state: str  # delivered | pending | dead
    dead_reason: str | None = None
    next_attempt_at: float | None = None
    attempts_delta: int = 0  # -1 when the claimed message was not sent (released, expired unsent)
    last_status: int | None = None
    last_error: str | None = None
    origin: str | None = None  # write back this origin (the row's differed from endpoint_origin)


class ClaimedBatch(list[Claimed]):
    """What one claim leased, in order; whether it was ``contended`` (PostgreSQL: another
    claim took or held rows it meant to lease) and how many due rows it ``retired`` (see
    ``outbox/claim_sql.py``): either way, due work may be left to claim at once."""

    contended: bool = False
    retired: int = 0


@dataclass(frozen=True)
class RescuedLease:
    """A message handed back when its lease ran out, with the lease it held: the attempt it
    was on is recorded ``abandoned``, naming the daemon that held it."""

    id: int
    tenant_id: str
    url: str
    attempts: int
    idempotency_key: str
    sequence_number: int | None
    notification_type: str | None
    trigger: str
    payload_size: int
    leased_by: str | None
    lease_expires_at: float

    def started_at(self, lease_seconds: float) -> float:
        """When the abandoned attempt's lease began: its expiry less the lease length (the
        rescuing daemon's; daemons configured alike lease alike)."""
        return self.lease_expires_at - lease_seconds
