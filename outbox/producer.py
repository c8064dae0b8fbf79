"""The producer API: enqueue a webhook inside the seller's own transaction.

Everything is validated and rendered before the first write, so a rejected call leaves the
caller's transaction untouched. The body is serialized exactly once, here, and those bytes
are what every attempt and every replay will POST (docs/architecture.md, "Exact bytes"). Nothing here
commits: the message exists if and only if the seller's transaction commits.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from outbox import protocol
from outbox.arguments import as_mapping, check_string, checked_horizon, is_utf8, one_of, optional_string
from outbox.config import Settings, load_settings
from outbox.errors import OutboxValidationError
from outbox.wire import json_default, json_problem
from outbox.identity import (
    EnqueuedMessage,
    binding_material,
    decode_body,
    escapes_lone_surrogate,
    is_stream_key,
    store_bound,
    stream_key as scoped_stream_key,
)
from outbox.keyset import producer_keys
from outbox.numbering import NUMBER_PLACEHOLDER, store_numbered
from outbox.tracecontext import current_traceparent
from outbox.urls import earlier_spelling, origin, validate_destination

Conn = Connection | Session
__all__ = ["EnqueuedMessage", "decode_body", "enqueue", "enqueue_delivery_report", "enqueue_task_webhook"]


@dataclass(frozen=True)
class _Registration:
    """A validated ``push_notification_config`` / ``reporting_webhook``."""

    url: str
    token: str | None
    operation_id: str | None
    auth_mode: str
    credentials: str | None


@functools.lru_cache(maxsize=1)
def default_settings() -> Settings:
    """Settings from the environment, read once per process (pass ``settings=`` to override)."""
    return load_settings()


def _registration(raw: Any, field: str, settings: Settings, *, require_operation_id: bool) -> _Registration:
    config = as_mapping(raw, field)
    url = validate_destination(config.get("url"), allow_http=settings.allow_http, allowed_cidrs=settings.allowed_cidrs)
    token = config.get("token")
    if token is not None:
        if not isinstance(token, str) or not protocol.TOKEN_LENGTH[0] <= len(token) <= protocol.TOKEN_LENGTH[1]:
            raise OutboxValidationError(f"{field}.token", "must be a string of 16 to 4096 characters")
    operation_id = config.get("operation_id")
    if require_operation_id or operation_id is not None:
        # docs/protocol.md "Webhook bodies": echoed verbatim, never derived from the URL.
        check_string(operation_id, f"{field}.operation_id", protocol.OPERATION_ID_RE)
    auth_mode, credentials = "rfc9421", None
    authentication = config.get("authentication")
    if authentication is not None:
        auth = as_mapping(authentication, f"{field}.authentication")
        schemes = auth.get("schemes")
        if (not isinstance(schemes, (list, tuple)) or len(schemes) != 1 or not isinstance(schemes[0], str)
                or schemes[0] not in protocol.LEGACY_SCHEMES):
            raise OutboxValidationError(f"{field}.authentication.schemes", 'must be ["HMAC-SHA256"] or ["Bearer"]')
        credentials = auth.get("credentials")
        if (not isinstance(credentials, str)
                or not protocol.MIN_LEGACY_CREDENTIAL_LENGTH <= len(credentials) <= protocol.TOKEN_LENGTH[1]):
            raise OutboxValidationError(  # the upper bound: a Bearer header every receiver accepts
                f"{field}.authentication.credentials",
                f"must be {protocol.MIN_LEGACY_CREDENTIAL_LENGTH} to {protocol.TOKEN_LENGTH[1]} characters",
            )
        if not protocol.LEGACY_CREDENTIAL_RE.fullmatch(credentials):
            # It becomes a header value (Bearer) or an HMAC key the buyer types into config.
            raise OutboxValidationError(f"{field}.authentication.credentials",
                                        "must be visible ASCII (no spaces, control or non-ASCII characters)")
        if settings.encryption_key is None:
            raise OutboxValidationError(
                f"{field}.authentication",
                "legacy credentials are stored encrypted: set OUTBOX_ENCRYPTION_KEY first",
            )
        auth_mode = protocol.LEGACY_SCHEMES[schemes[0]]
    return _Registration(url, token, operation_id, auth_mode, credentials)


def _idempotency_key(given: str | None) -> str:
    if given is None:
        return f"whk_{uuid.uuid4()}"  # docs/protocol.md "Idempotency": cryptographically random, the SDK's format
    return check_string(given, "idempotency_key", protocol.IDEMPOTENCY_KEY_RE)


def _render(envelope: Mapping[str, Any], root: str = "") -> bytes:
    """Serialize once: compact, UTF-8, and strictly JSON (no NaN, no non-string keys).

    ``root`` names the argument ``envelope`` came from when it is the caller's own mapping
    (``payload``); otherwise an error names the envelope's field (``result``, ``context``).
    """
    _check_json(envelope, root)
    try:
        body = json.dumps(envelope, separators=(",", ":"), ensure_ascii=False, allow_nan=False,
                          default=json_default).encode("utf-8")
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError (lone surrogates) is a ValueError
        raise OutboxValidationError(root or "result", f"is not JSON-serializable ({exc})") from None
    if len(body) > protocol.MAX_BODY_BYTES:
        raise OutboxValidationError(root or "result", f"the webhook body is {len(body)} bytes, over the 1 MiB limit")
    return body


def _check_json(value: Any, root: str) -> None:
    problem = json_problem(value)
    if problem is not None:
        path, reason = problem
        raise OutboxValidationError(".".join(filter(None, (root, path))) or "body", reason)


def _timestamp() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _connection(conn: Conn, *, minted: bool = False) -> Connection:
    """The caller's connection. A ``Session`` with autoflush (the default) sends its pending
    changes first when the enqueue ``minted`` its key, as a query would: the row may then
    ride the ``COMMIT`` alone, where the commit's own flush would send it ahead of the
    flushed statements, in a round trip of its own (docs/enqueue.md, "When the row is written")."""
    if isinstance(conn, Session):
        if minted and conn.autoflush:
            conn.flush()
        return conn.connection()
    if not isinstance(conn, Connection):  # an Engine, a DBAPI connection: nothing to share a transaction with
        raise TypeError(f"conn must be the seller's SQLAlchemy Connection or Session, inside the transaction "
                        f"the enqueue belongs to, not {type(conn).__name__}")
    return conn


def _row(
    tenant_id: str, registration: _Registration, key: str, body: bytes, content: Mapping[str, Any],
    settings: Settings, columns: Mapping[str, Any],
) -> dict[str, Any]:
    """The rendered message row, for :func:`outbox.identity.store_bound`: the plaintext body
    and credential (sealed when stored) and the binding material taken from ``content``,
    the mapping ``body`` was rendered from."""
    row = {
        "tenant_id": tenant_id,
        "url": registration.url,
        "origin": origin(registration.url),
        "idempotency_key": key,
        "body": body,
        "credentials": registration.credentials,
        "auth_mode": registration.auth_mode,
        "operation_id": registration.operation_id,
        **columns,
    }
    row["material"] = binding_material(row, content)
    row.update(_attribution(traceparent=current_traceparent()))  # transport, not bound content
    return row


def _tenant(tenant_id: Any) -> str:
    return check_string(tenant_id, "tenant_id")


def _attribution(**columns: str | None) -> dict[str, str]:
    """The attribution columns that are set: a producer on a schema one migration behind
    (a rolling upgrade) writes none of the columns it does not use."""
    return {name: value for name, value in columns.items() if value is not None}


def _event_id(body: Mapping[str, Any]) -> str | None:
    """The payload's ``notification_id`` when it is a valid one, kept for the activity log."""
    value = body.get("notification_id")
    return value if isinstance(value, str) and protocol.NOTIFICATION_ID_RE.fullmatch(value) else None


def principal(principal_id: Any) -> str | None:
    """The buyer principal a notification belongs to (``None``: the seller did not say)."""
    return optional_string(principal_id, "principal_id")


def enqueue_task_webhook(
    conn: Conn,
    *,
    tenant_id: str,
    push_notification_config: Any,
    task_id: str,
    task_type: str,
    status: str,
    result: Any = None,
    message: str | None = None,
    context_id: str | None = None,
    context: Mapping[str, Any] | None = None,
    idempotency_key: str | None = None,
    notification_id: str | None = None,
    horizon_seconds: int | None = None,
    principal_id: str | None = None,
    adcp_version: str | None = None,
    settings: Settings | None = None,
) -> EnqueuedMessage:
    """Enqueue an MCP task-status webhook (docs/protocol.md "Webhook bodies") in the caller's transaction.

    Call it in the same transaction that moves the task to ``status``; it never commits.
    Terminal statuses get ``notification_id = "<task_id>.terminal"`` unless given.
    ``principal_id`` names the buyer principal the notification belongs to. ``adcp_version``
    is the release the task's request was served as (the SDK's ``resolved_adcp_version``):
    the registration must carry ``operation_id`` unless that release is AdCP 3.0.
    """
    settings = settings or default_settings()
    tenant = _tenant(tenant_id)
    registration = _registration(push_notification_config, "push_notification_config", settings,
                                 require_operation_id=protocol.requires_operation_id(
                                     optional_string(adcp_version, "adcp_version")))
    check_string(task_id, "task_id")
    one_of(task_type, protocol.TASK_TYPES, "task_type", "an AdCP task type")
    one_of(status, protocol.TASK_STATUSES, "status", "an AdCP task status")
    if message is not None and (not isinstance(message, str) or not is_utf8(message)):
        raise OutboxValidationError("message", "must be a string of valid UTF-8 text")
    optional_string(context_id, "context_id")
    horizon = checked_horizon(horizon_seconds)
    if notification_id is None and status in protocol.TERMINAL_STATUSES:
        notification_id = check_string(f"{task_id}.terminal", "task_id", protocol.NOTIFICATION_ID_RE,
                                        "the notification_id pattern once '.terminal' is appended")
    elif notification_id is not None:
        check_string(notification_id, "notification_id", protocol.NOTIFICATION_ID_RE)
    if context is not None:
        context = as_mapping(context, "context")
    key = _idempotency_key(idempotency_key)
    envelope: dict[str, Any] = {"idempotency_key": key}
    if registration.operation_id is not None:  # absent only for an AdCP 3.0 registration
        envelope["operation_id"] = registration.operation_id
    envelope.update({"task_id": task_id, "task_type": task_type, "status": status, "timestamp": _timestamp()})
    optional = {"notification_id": notification_id, "message": message, "context_id": context_id,
                "token": registration.token, "result": result, "context": context}
    envelope.update({k: v for k, v in optional.items() if v is not None})
    row = _row(tenant, registration, key, _render(envelope), envelope, settings,
               {"task_id": task_id, "task_type": task_type, "task_status": status, "horizon_seconds": horizon,
                **_attribution(principal_id=principal(principal_id))})
    connection = _connection(conn, minted=idempotency_key is None)
    return store_bound(connection, row, producer_keys(connection, settings), minted=idempotency_key is None)


def enqueue_delivery_report(
    conn: Conn,
    *,
    tenant_id: str,
    reporting_webhook: Any,
    media_buy_id: str,
    result: Mapping[str, Any],
    stream_key: str | None = None,
    task_id: str | None = None,
    idempotency_key: str | None = None,
    horizon_seconds: int | None = None,
    principal_id: str | None = None,
    settings: Settings | None = None,
) -> EnqueuedMessage:
    """Enqueue a ``media_buy_delivery`` report with the stream's next ``sequence_number``.

    The number is allocated in the caller's transaction (docs/protocol.md "Delivery
    reports"): it starts at 1, has no gaps, increases in commit order, and a rollback gives
    it back. The stream is the tenant's: tenant + media buy + receiver URL by default (each subscriber sees
    contiguous numbers), or tenant + ``stream_key``. Everything that can fail, the
    idempotency check included, runs before the number is allocated. The stream row stays
    locked until the caller commits: enqueue reports last.
    ``principal_id`` scopes the report's attempts in :func:`outbox.webhook_activity`.
    ``task_id`` names this report (``delivery_report_<idempotency_key>`` by default): give
    each report its own, as buyers' receivers treat one task_id as one finished task.
    """
    settings = settings or default_settings()
    tenant = _tenant(tenant_id)
    registration = _registration(reporting_webhook, "reporting_webhook", settings, require_operation_id=True)
    check_string(media_buy_id, "media_buy_id")
    report = dict(as_mapping(result, "result"))
    notification_type = report.get("notification_type")
    if notification_type is not None:
        one_of(notification_type, protocol.DELIVERY_NOTIFICATION_TYPES, "result.notification_type",
                "a delivery notification type")
    optional_string(stream_key, "stream_key")
    optional_string(task_id, "task_id")
    horizon = checked_horizon(horizon_seconds)
    owner = principal(principal_id)
    key = _idempotency_key(idempotency_key)
    envelope: dict[str, Any] = {
        "idempotency_key": key,
        "operation_id": registration.operation_id,
        # One task per report: a buyer's receiver keys a finished task by its task_id (the adcp
        # SDK's WebhookReceiver answers a second, different result under one task_id with 409),
        # so reports of one media buy must not share one. Derived from the idempotency key, it
        # is the same on a same-key retry, whose body must match the stored one.
        "task_id": task_id or f"delivery_report_{key}",
        "task_type": protocol.DELIVERY_TASK_TYPE,
        "status": "completed",
        "timestamp": _timestamp(),
    }
    if registration.token is not None:
        envelope["token"] = registration.token
    # The number comes last in ``result``, itself last in the envelope: the rendered body
    # ends with it, and its digits are written in once allocated (outbox/numbering.py).
    # Rendered with the widest number, so the size check sees the longest body.
    report.pop("sequence_number", None)
    report["sequence_number"] = NUMBER_PLACEHOLDER
    envelope["result"] = report
    stream = scoped_stream_key(tenant, stream_key) if stream_key else scoped_stream_key(tenant, media_buy_id,
                                                                                        registration.url)
    seeds = _earlier_streams(tenant, media_buy_id, stream_key, as_mapping(reporting_webhook, "reporting_webhook"))
    columns = {"task_id": envelope["task_id"], "task_type": protocol.DELIVERY_TASK_TYPE, "task_status": "completed",
               "notification_type": notification_type, "sequence_key": stream, "horizon_seconds": horizon,
               **_attribution(media_buy_id=media_buy_id, principal_id=owner)}
    row = _row(tenant, registration, key, _render(envelope), envelope, settings, columns)
    connection = _connection(conn)
    return store_numbered(connection, row, producer_keys(connection, settings), stream=stream,
                          seeds=seeds, replay=idempotency_key is not None)


def _earlier_streams(tenant: str, media_buy_id: str, stream_key: str | None, webhook: Mapping[str, Any]) -> list[str]:
    """The keys earlier releases numbered this stream under, whose counter it continues: the
    pre-0002 key (never another tenant's scoped key, which a ``stream_key`` spelled like one
    would otherwise continue), and for the default stream the key of the URL as releases up to
    0.2.0 spelled it (the query's escapes as written)."""
    if stream_key:
        return [] if is_stream_key(stream_key) else [stream_key]
    earlier = earlier_spelling(webhook["url"])
    pre_0002 = f"{tenant}:{media_buy_id}:{earlier}"
    return [*([] if is_stream_key(pre_0002) else [pre_0002]), scoped_stream_key(tenant, media_buy_id, earlier)]


def exact_body(body: bytes, field: str) -> tuple[dict[str, Any], str]:
    """A body given as the exact bytes to send: its JSON object and its ``idempotency_key``."""
    if len(body) > protocol.MAX_BODY_BYTES:
        raise OutboxValidationError(field, f"the webhook body is {len(body)} bytes, over the 1 MiB limit")
    decoded = decode_body(body)
    if decoded is None:
        raise OutboxValidationError(field, "must be a UTF-8 JSON object")
    _check_json(decoded, field)
    if escapes_lone_surrogate(body, decoded):
        raise OutboxValidationError(field, "escapes an unpaired surrogate (\\uD800-\\uDFFF alone): not valid Unicode")
    key = check_string(decoded.get("idempotency_key"), f"{field}.idempotency_key", protocol.IDEMPOTENCY_KEY_RE)
    return decoded, key


def enqueue(
    conn: Conn,
    *,
    tenant_id: str,
    url: str,
    payload: Mapping[str, Any] | bytes,
    idempotency_key: str | None = None,
    authentication: Mapping[str, Any] | None = None,
    notification_type: str | None = None,
    horizon_seconds: int | None = None,
    principal_id: str | None = None,
    media_buy_id: str | None = None,
    account_id: str | None = None,
    subscriber_id: str | None = None,
    settings: Settings | None = None,
) -> EnqueuedMessage:
    """Enqueue any other AdCP notification body on the same delivery contract (docs/protocol.md "Webhook bodies").

    ``payload`` is a mapping (its ``idempotency_key`` is set, or minted) or the exact JSON
    bytes to send, which must be an object carrying a valid ``idempotency_key``.
    ``principal_id``, ``media_buy_id``, ``account_id`` and ``subscriber_id`` attribute it in
    :func:`outbox.webhook_activity`.
    """
    settings = settings or default_settings()
    tenant = _tenant(tenant_id)
    registration = _registration({"url": url, "authentication": authentication}, "url", settings,
                                 require_operation_id=False)
    minted = False
    if isinstance(payload, (bytes, bytearray)):
        body = bytes(payload)
        decoded, key = exact_body(body, "payload")
        if idempotency_key is not None and idempotency_key != key:
            raise OutboxValidationError("idempotency_key", "differs from payload.idempotency_key")
    else:
        envelope = dict(as_mapping(payload, "payload"))
        in_payload = envelope.get("idempotency_key")
        if idempotency_key is not None and in_payload is not None and in_payload != idempotency_key:
            raise OutboxValidationError("idempotency_key", "differs from payload.idempotency_key")
        minted = idempotency_key is None and in_payload is None
        key = _idempotency_key(idempotency_key if idempotency_key is not None else in_payload)
        envelope["idempotency_key"] = key
        body = _render(envelope, "payload")
        decoded = envelope
    row = _row(tenant, registration, key, body, decoded, settings,
               {"notification_type": optional_string(notification_type, "notification_type"),
                "horizon_seconds": checked_horizon(horizon_seconds),
                **_attribution(principal_id=principal(principal_id), notification_id=_event_id(decoded),
                               media_buy_id=optional_string(media_buy_id, "media_buy_id"),
                               account_id=optional_string(account_id, "account_id"),
                               subscriber_id=optional_string(subscriber_id, "subscriber_id"))})
    connection = _connection(conn, minted=minted)
    return store_bound(connection, row, producer_keys(connection, settings), minted=minted)
