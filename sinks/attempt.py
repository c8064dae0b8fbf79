"""The attempt record, named and shaped like the ``adcp`` SDK's ``DeliveryAttempt``.

It carries the fields of the SDK record and of AdCP's ``webhook-activity-record``
(docs/protocol.md "Attempt records"), so a buyer-facing activity log can be served straight from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

# docs/protocol.md "Attempt records" status values, plus what only a durable outbox can observe.
OUTCOMES = ("success", "failed", "timeout", "connection_error", "circuit_open", "abandoned")


@dataclass(frozen=True)
class DeliveryAttempt:
    """One HTTP attempt at delivering one message (or one cut short by a crash: ``abandoned``)."""

    message_id: int
    tenant_id: str
    url: str  # without query or fragment (docs/protocol.md "Attempt records")
    attempt_number: int  # 1-indexed
    outcome: str  # one of OUTCOMES
    http_status_code: int | None
    error_message: str | None  # redacted, at most 200 characters, never headers or bodies
    response_time_ms: int | None
    will_retry: bool
    next_retry_at: float | None  # epoch seconds, database clock
    payload_size_bytes: int
    sequence_number: int | None
    idempotency_key: str  # equals the payload's value (docs/protocol.md "Attempt records")
    notification_type: str | None
    trigger: str  # scheduled | replay
    daemon_id: str
    occurred_at: float  # epoch seconds, database clock
    trace_id: str | None = None  # the attempt's OpenTelemetry span, when tracing is on
    span_id: str | None = None

    def as_row(self) -> dict[str, Any]:
        """The ``outbox_attempts`` row for this attempt."""
        return {
            "message_id": self.message_id, "tenant_id": self.tenant_id, "url": self.url,
            "attempt_number": self.attempt_number, "outcome": self.outcome, "http_status": self.http_status_code,
            "error": self.error_message, "response_time_ms": self.response_time_ms,
            "will_retry": self.will_retry, "next_retry_at": self.next_retry_at,
            "payload_size": self.payload_size_bytes, "sequence_number": self.sequence_number,
            "idempotency_key": self.idempotency_key, "notification_type": self.notification_type,
            "trigger": self.trigger, "daemon_id": self.daemon_id, "occurred_at": self.occurred_at,
            "trace_id": self.trace_id, "span_id": self.span_id,
        }

    def as_dict(self) -> dict[str, Any]:
        """The record's fields; the span ids only when there is a span (tracing on)."""
        data = dict(vars(self))  # every field is a scalar: a shallow copy is the whole record
        if self.trace_id is None:
            del data["trace_id"], data["span_id"]
        return data


@runtime_checkable
class DeliveryLogSink(Protocol):
    """Anything that wants every attempt: ``async def record(attempt) -> None``.

    The SDK's protocol, unchanged, so sinks written for ``InMemoryWebhookDeliverySupervisor``
    plug in here by dotted path (``OUTBOX_SINKS=package.module:ClassName``).
    """

    async def record(self, attempt: DeliveryAttempt) -> None: ...
