"""What one outcome writes: its message's next state and, when a request was made, its attempt record.

A pure function of the outcome, the database's time and the retry policy, so the completer
can plan a whole batch before its one transaction (docs/architecture.md, "Batched completion
and hot rows").
"""

from __future__ import annotations

from outbox.leases import Completion
from outbox.urls import public_url, redact_urls
from sinks.attempt import DeliveryAttempt
from supervisor.cycle.attempt import Outcome
from supervisor.wire.classify import RetryPolicy, retry_at

UNSENT = ("expire", "release", "hold")  # claimed but not sent: no attempt made, none counted or logged
# A message the daemon cannot prepare now (its scope has no active signing key, or it is sealed
# under a key this process lacks) waits this long before it is claimed again, by this daemon or
# one that can: a promoted signing key signs one second after it commits (supervisor/keys/keyring.py),
# and docs/encryption.md ("Without the key") says what holds a sealed one.
HOLD_SECONDS = 5.0


def plan(o: Outcome, now: float, *, retry: RetryPolicy, daemon_id: str, revoked: bool = False
         ) -> tuple[Completion, DeliveryAttempt | None]:
    """The message's new state, and its attempt record (``None``: no attempt was made);
    ``revoked``: its subscriber is gone or paused, so it is not tried again."""
    m = o.message
    state, reason, next_at, delta = "pending", None, None, 0
    if o.action == "delivered":
        state = "delivered"
    elif o.action in ("dead", "expire"):
        state, reason = "dead", o.reason
    elif o.action == "release":
        next_at = now
    elif o.action == "hold":
        next_at = now + HOLD_SECONDS
    elif o.outcome == "abandoned":  # interrupted at shutdown: due again at once
        next_at = now
    else:  # retry
        delay = max(retry.delay_for_attempt(m.attempt), o.retry_after or 0.0)
        next_at = retry_at(now, delay, m.retry_until)
        if next_at is None:
            state, reason = "dead", "expired"
    if state == "pending" and revoked:
        state, reason, next_at = "dead", "cancelled", None
    if o.action in UNSENT:
        delta = -1
    error = redact_urls(o.error) if o.error else o.error  # an error may quote a URL: never its secrets
    completion = Completion(m.id, m.lease_token, state, reason, next_at, delta, o.http_status, error,
                            origin=m.origin if m.origin != m.stored_origin else None)
    if o.action in UNSENT:
        return completion, None
    record = DeliveryAttempt(
        message_id=m.id, tenant_id=m.tenant_id, url=public_url(m.url), attempt_number=m.attempt,
        outcome=o.outcome, http_status_code=o.http_status, error_message=error,
        response_time_ms=o.response_time_ms, will_retry=state == "pending",
        next_retry_at=next_at if state == "pending" else None, payload_size_bytes=len(m.body),
        sequence_number=m.sequence_number, idempotency_key=m.idempotency_key,
        notification_type=m.notification_type, trigger=m.trigger, daemon_id=daemon_id, occurred_at=now,
        trace_id=o.trace[0] if o.trace else None, span_id=o.trace[1] if o.trace else None,
    )
    return completion, record

