"""``enqueue_event``: one account-anchored event, fanned out to the account's subscribers.

Every active or pending-proof subscriber whose ``event_types`` include the type gets its
own message (own ``idempotency_key``, its ``subscriber_id`` echoed), all sharing one
``notification_id`` (AdCP 3.2 account-anchored webhook payloads, e.g.
https://adcontextprotocol.org/schemas/3.2.4/core/account-status-changed-webhook.json).
A fire for a subscriber still proving its URL is *held* (see :mod:`outbox.subscribers`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from sqlalchemy import select

from outbox import protocol
from outbox.config import Settings
from outbox.errors import OutboxValidationError
from outbox.identity import store_bound
from outbox.keyset import producer_keys
from outbox.producer import (
    Conn,
    EnqueuedMessage,
    _as_mapping,
    _check_string,
    _connection,
    _idempotency_key,
    _member,
    _Registration,
    _render,
    _row,
    _tenant,
    _timestamp,
    default_settings,
)
from outbox.schema import subscribers
from outbox.subscribers import HOLD_UNTIL, open_credential

_SET_PER_FIRE = ("idempotency_key", "notification_id", "fired_at", "subscriber_id")


def _credentials(row: Any, settings: Settings) -> str | None:
    return None if row.auth_secret is None else open_credential(settings, row)


def enqueue_event(
    conn: Conn,
    *,
    tenant_id: str,
    account_id: str,
    notification_type: str,
    payload: Mapping[str, Any],
    notification_id: str | None = None,
    settings: Settings | None = None,
) -> list[EnqueuedMessage]:
    """Enqueue one account-anchored event for every matching subscriber, in the caller's
    transaction (never commits); returns one :class:`EnqueuedMessage` per subscriber.

    ``payload`` is the event's own fields (``account_id``, ``status``, ...); this function
    adds ``idempotency_key``, ``notification_id`` (the caller's, or one minted per call),
    ``notification_type``, ``fired_at`` and ``subscriber_id``. Paused and failed
    subscribers get nothing; the filter is never widened.
    """
    settings = settings or default_settings()
    tenant = _tenant(tenant_id)
    account = _check_string(account_id, "account_id")
    _member(notification_type, protocol.ACCOUNT_EVENT_TYPES, "notification_type", "an account-anchored type")
    event_id = (f"evt_{uuid.uuid4().hex}" if notification_id is None
                else _check_string(notification_id, "notification_id", protocol.NOTIFICATION_ID_RE))
    fields = dict(_as_mapping(payload, "payload"))
    for name in _SET_PER_FIRE:
        if name in fields:
            raise OutboxValidationError(f"payload.{name}", "is set by enqueue_event, per fire")
    if fields.pop("notification_type", notification_type) != notification_type:
        raise OutboxValidationError("payload.notification_type", "differs from notification_type")
    connection = _connection(conn)
    query = (select(subscribers).where(subscribers.c.tenant_id == tenant, subscribers.c.account_id == account,
                                       subscribers.c.state.in_(("active", "pending_proof")))
             .order_by(subscribers.c.subscriber_id))
    if connection.dialect.name == "postgresql":
        # A proof settling concurrently waits for this transaction (and then releases the
        # fires it holds), or this one reads the subscriber as already active: never a fire
        # held after its release ran.
        query = query.with_for_update(read=True)
    fired_at = _timestamp()
    fires = []
    for row in connection.execute(query):  # render and unseal all first: a failure writes nothing
        if notification_type not in json.loads(row.event_types):
            continue
        key = _idempotency_key(None)
        content = {"idempotency_key": key, "notification_id": event_id, "notification_type": notification_type,
                   "fired_at": fired_at, "subscriber_id": row.subscriber_id, **fields}
        registration = _Registration(row.url, None, None, row.auth_mode, _credentials(row, settings))
        columns: dict[str, Any] = {"notification_type": notification_type, "notification_id": event_id,
                                   "account_id": account, "subscriber_id": row.subscriber_id,
                                   "subscriber_ref": row.id, "principal_id": row.principal_id}
        if row.state == "pending_proof":
            columns.update(held=True, next_attempt_at=HOLD_UNTIL)
        fires.append(_row(tenant, registration, key, _render(content), content, settings, columns))
    keys = producer_keys(connection, settings)
    return [store_bound(connection, fire, keys) for fire in fires]
