"""``webhook_activity``: the buyer-visible delivery log, served from the attempt history.

AdCP 3.2 lets ``get_media_buys``, ``list_creatives`` and ``list_accounts`` return
``webhook_activity[]`` (https://adcontextprotocol.org/schemas/3.2.4/core/webhook-activity-record.json,
"webhook activity log pattern" in
https://adcontextprotocol.org/docs/protocol/snapshot-and-log): one record per
HTTP attempt of a notification-typed fire, newest first, scoped to the calling principal.
outboxd records every attempt already, so this is one indexed read of ``outbox_attempts``
joined with ``outbox_messages`` (plus one record per fire still queued or in flight).
Task-status webhooks carry no ``notification_type`` and are not part of it.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from sqlalchemy import Select, func, select

from outbox import protocol
from outbox.arguments import check_string
from outbox.config import Settings
from outbox.errors import OutboxValidationError
from outbox.producer import Conn, _connection, _tenant, default_settings, principal
from outbox.schema import attempts, messages
from outbox.urls import public_url

MAX_LIMIT = 200  # get-media-buys-request webhook_activity_limit: 1..200
_UUID = re.compile(r"^[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}$")
_TOKEN = re.compile(r"^[A-Za-z0-9_\-.~+=]{16,}$")
REDACTED = "redacted"
# Our attempt outcomes in the record's status vocabulary. A failure without any HTTP
# answer (destination blocked, attempt interrupted) is a connection_error: "before any
# HTTP response"; circuit-open skips were never attempts and are not listed.
_STATUS = {"success": "success", "failed": "failed", "timeout": "timeout", "connection_error": "connection_error",
           "abandoned": "connection_error"}


def secret_looking(segment: str) -> bool:
    """A path segment that looks like a credential: a UUID, or long mixed random material."""
    if _UUID.fullmatch(segment):
        return True
    return bool(_TOKEN.fullmatch(segment)) and any(c.isdigit() for c in segment) \
        and any(c.isalpha() for c in segment) and len(set(segment)) >= 10


def activity_url(url: str) -> str:
    """The URL as a buyer may see it: :func:`outbox.urls.public_url` (no userinfo, query or
    fragment), with secret-looking path segments redacted too."""
    parts = urlsplit(public_url(url))
    path = "/".join(REDACTED if secret_looking(s) else s for s in parts.path.split("/"))
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def rfc3339(epoch: float | None) -> str | None:
    """An epoch time as RFC 3339 in UTC with a ``Z`` (what Svix and Convoy print), to the millisecond."""
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _scoped(query: Select[Any], *, tenant: str, owner: str | None, filters: dict[str, str]) -> Select[Any]:
    """Only this tenant's notification fires of this principal (``None``: fires with no principal)."""
    query = query.where(messages.c.tenant_id == tenant,
                        messages.c.notification_type.in_(sorted(protocol.NOTIFICATION_TYPES)),
                        messages.c.principal_id.is_(None) if owner is None else messages.c.principal_id == owner)
    for name, value in filters.items():
        query = query.where(messages.c[name] == value)
    return query


def _common(row: Any, attempt: int, status: str, fired_at: float, completed_at: float | None) -> dict[str, Any]:
    record: dict[str, Any] = {"idempotency_key": row.idempotency_key}
    if row.notification_id is not None:
        record["notification_id"] = row.notification_id
    if row.subscriber_id is not None:
        record["subscriber_id"] = row.subscriber_id
    record.update(fired_at=rfc3339(fired_at), completed_at=None if completed_at is None else rfc3339(completed_at),
                  notification_type=row.notification_type)
    if row.sequence_number is not None:
        record["sequence_number"] = row.sequence_number
    record.update(attempt=attempt, status=status, url=activity_url(row.url))
    return record


def _attempt_record(row: Any) -> dict[str, Any]:
    status = _STATUS[row.outcome]
    answered = status in ("success", "failed") and row.http_status is not None
    if status == "failed" and not answered:
        status = "connection_error"  # no HTTP answer: the schema reserves failed for non-2xx responses
    elapsed = (row.response_time_ms or 0) / 1000
    record = _common(row, row.attempt_number, status, row.occurred_at - elapsed, row.occurred_at)
    record.update(http_status_code=row.http_status if answered else None,
                  response_time_ms=row.response_time_ms if answered else None, payload_size_bytes=row.payload_size,
                  error_message=None if status == "success" else (row.error or status.replace("_", " "))[:500])
    return record


def _pending_record(row: Any, lease_seconds: float) -> dict[str, Any]:
    """A fire in flight (attempt under way) or queued for its next attempt."""
    if row.state == "in_flight":
        attempt, fired_at = row.attempts, (row.lease_expires_at or row.next_attempt_at) - lease_seconds
    else:
        attempt, fired_at = row.attempts + 1, row.created_at if row.held else max(row.next_attempt_at, row.created_at)
    record = _common(row, max(attempt, 1), "pending", fired_at, None)
    record.update(http_status_code=None, response_time_ms=None, payload_size_bytes=row.payload_size,
                  error_message=None)
    return record


def webhook_activity(
    conn: Conn,
    *,
    tenant_id: str,
    principal_id: str | None = None,
    account_id: str | None = None,
    media_buy_id: str | None = None,
    task_id: str | None = None,
    subscriber_id: str | None = None,
    limit: int = 50,
    settings: Settings | None = None,
) -> list[dict[str, Any]]:
    """Up to ``limit`` ``webhook-activity-record`` dicts, newest first, for one principal.

    A principal sees only fires enqueued with its ``principal_id`` (``None`` sees only fires
    enqueued without one); every filter is an exact match. Records are kept at least
    ``OUTBOX_ACTIVITY_RETENTION_DAYS`` (>= 30) after they complete: ``outboxd purge`` never
    deletes younger attempt rows. Read-only; runs in the caller's transaction.
    """
    settings = settings or default_settings()
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIMIT:
        raise OutboxValidationError("limit", f"must be an integer within 1..{MAX_LIMIT}")
    given = {"account_id": account_id, "media_buy_id": media_buy_id, "task_id": task_id,
             "subscriber_id": subscriber_id}
    filters = {name: check_string(value, name) for name, value in given.items() if value is not None}
    tenant, owner = _tenant(tenant_id), principal(principal_id)
    shared = (messages.c.idempotency_key, messages.c.notification_id, messages.c.subscriber_id,
              messages.c.notification_type, messages.c.url)
    done = _scoped(select(*shared, attempts.c.sequence_number, attempts.c.attempt_number, attempts.c.outcome,
                          attempts.c.http_status, attempts.c.error, attempts.c.response_time_ms,
                          attempts.c.payload_size, attempts.c.occurred_at)
                   .join(attempts, attempts.c.message_id == messages.c.id)
                   .where(attempts.c.outcome.in_(sorted(_STATUS))),
                   tenant=tenant, owner=owner, filters=filters)
    done = done.order_by(attempts.c.occurred_at.desc(), attempts.c.id.desc()).limit(limit)
    waiting = _scoped(select(*shared, messages.c.sequence_number, messages.c.state, messages.c.attempts,
                             messages.c.held, messages.c.created_at, messages.c.next_attempt_at,
                             messages.c.lease_expires_at, func.length(messages.c.body).label("payload_size"))
                      .where(messages.c.state.in_(("pending", "in_flight"))),
                      tenant=tenant, owner=owner, filters=filters)
    waiting = waiting.order_by(messages.c.created_at.desc(), messages.c.id.desc()).limit(limit)
    connection = _connection(conn)
    records = [_attempt_record(r) for r in connection.execute(done)]
    records += [_pending_record(r, settings.lease_seconds) for r in connection.execute(waiting)]
    records.sort(key=lambda r: (r["fired_at"], r["attempt"]), reverse=True)
    return records[:limit]

