"""Account-level notification subscribers: AdCP 3.2 ``notification_configs[]`` made durable.

A seller handling ``sync_accounts`` hands each ``accounts[].notification_configs[]`` entry
to :func:`register_subscriber` in the transaction that stores the account. A new or changed
active subscriber is not trusted yet: registration queues a signed ``webhook.challenge`` for
``outboxd`` to send, and the subscriber is ``active`` only once the receiver echoed it
(https://adcontextprotocol.org/docs/building/by-layer/L3/webhooks, and docs/subscribers.md).
Fires enqueued meanwhile are *held*: due only in the far future, so no claim ever takes
them, until the proof releases them or fails them (dead ``proof_failed``).

Nothing here commits; like the rest of the producer API it runs in the caller's transaction.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Select, Update, delete, select, text, update

from outbox import protocol
from outbox.arguments import as_mapping, check_string
from outbox.config import Settings
from outbox.errors import ConfigurationError, OutboxValidationError
from outbox.identity import store_bound
from outbox.producer import (
    Conn,
    _connection,
    _registration,
    _render,
    _Registration,
    _row,
    _tenant,
    default_settings,
    principal,
)
from outbox.schema import db_now, messages, subscribers
from outbox.keyset import producer_keys
from outbox.sealing import SUBSCRIBER_CREDENTIAL, SealingKeys

HOLD_UNTIL = 253_402_300_799.0  # 9999-12-31T23:59:59Z, the latest time tools can print: "until released"
_SCHEME_OF_MODE = {"hmac": "HMAC-SHA256", "bearer": "Bearer"}


@dataclass(frozen=True)
class Subscriber:
    """A subscriber as stored, without its credentials (they are write-only)."""

    tenant_id: str
    account_id: str
    subscriber_id: str
    url: str
    event_types: tuple[str, ...]
    active: bool
    state: str  # pending_proof | active | paused | proof_failed
    principal_id: str | None
    auth_scheme: str | None  # "Bearer" | "HMAC-SHA256" for legacy auth, else None (RFC 9421)
    proven_at: float | None
    challenge_message_id: int | None

    def config_state(self) -> dict[str, Any]:
        """The credential-free readback for ``list_accounts`` (``agent-notification-config-state``
        shape: the legacy selector names its scheme only)."""
        state: dict[str, Any] = {"subscriber_id": self.subscriber_id, "url": self.url,
                                 "event_types": list(self.event_types), "active": self.active}
        if self.auth_scheme is not None:
            state["authentication"] = {"schemes": [self.auth_scheme]}
        return state


def _record(row: Any) -> Subscriber:
    return Subscriber(
        tenant_id=row.tenant_id, account_id=row.account_id, subscriber_id=row.subscriber_id, url=row.url,
        event_types=tuple(json.loads(row.event_types)), active=bool(row.active), state=row.state,
        principal_id=row.principal_id, auth_scheme=_SCHEME_OF_MODE.get(row.auth_mode), proven_at=row.proven_at,
        challenge_message_id=row.challenge_message_id,
    )


def _event_types(raw: Any) -> list[str]:
    field = "notification_config.event_types"
    if not isinstance(raw, (list, tuple)) or not raw:
        raise OutboxValidationError(field, "must be a non-empty array of account-anchored notification types")
    for i, item in enumerate(raw):
        if not isinstance(item, str) or item not in protocol.ACCOUNT_EVENT_TYPES:
            raise OutboxValidationError(f"{field}[{i}]", f"{str(item)[:80]!r} is not an account-anchored type")
    if len(set(raw)) != len(raw):
        raise OutboxValidationError(field, "must not repeat a type")
    return sorted(raw)


def _validated(config: Any, settings: Settings) -> tuple[str, list[str], bool, _Registration]:
    config = as_mapping(config, "notification_config")
    for key in config:
        if key not in protocol.NOTIFICATION_CONFIG_KEYS:
            raise OutboxValidationError(f"notification_config.{key}", "is not a notification-config field")
    subscriber_id = check_string(config.get("subscriber_id"), "notification_config.subscriber_id",
                                  protocol.SUBSCRIBER_ID_RE)
    events = _event_types(config.get("event_types"))
    active = config.get("active", True)
    if not isinstance(active, bool):
        raise OutboxValidationError("notification_config.active", "must be true or false")
    view = config.get("product_payload_view")
    if view is not None and (view not in ("canonical", "legacy") or not any(e.startswith("product.") for e in events)):
        raise OutboxValidationError("notification_config.product_payload_view",
                                    "must be canonical or legacy, and only with a product.* event type")
    registration = _registration({"url": config.get("url"), "authentication": config.get("authentication")},
                                 "notification_config", settings, require_operation_id=False)
    return subscriber_id, events, active, registration


def _fingerprint(credentials: str | None) -> str | None:
    return None if credentials is None else hashlib.sha256(credentials.encode()).hexdigest()


def _config_digest(registration: _Registration, events: list[str]) -> str:
    """What a proof covers: URL, event set and delivery auth (a change needs a fresh proof)."""
    scope = [registration.url, events, registration.auth_mode, _fingerprint(registration.credentials)]
    return hashlib.sha256(json.dumps(scope).encode()).hexdigest()


def seal_credential(keys: SealingKeys | None, tenant_id: str, account_id: str, subscriber_id: str,
                    credential: str) -> bytes:
    """A subscriber's legacy credential sealed under the sealing key, bound to its own row."""
    assert keys is not None  # _registration refuses credentials without a key
    return keys.seal(SUBSCRIBER_CREDENTIAL, credential.encode(), tenant_id=tenant_id,
                     idempotency_key=credential_identity(account_id, subscriber_id))


def credential_identity(account_id: str, subscriber_id: str) -> str:
    """What a subscriber's sealed credential is bound to besides its tenant: its own row."""
    return json.dumps([account_id, subscriber_id])


def open_credential(settings: Settings, row: Any) -> str:
    """The plaintext of a subscriber row's sealed credential (``SealError`` if it does not open)."""
    keys = settings.sealing()
    if keys is None:
        raise ConfigurationError("subscriber credentials are stored encrypted: set OUTBOX_ENCRYPTION_KEY")
    return keys.open(SUBSCRIBER_CREDENTIAL, bytes(row.auth_secret), tenant_id=row.tenant_id,
                     idempotency_key=credential_identity(row.account_id, row.subscriber_id)).decode()


def release_held(subscriber_refs: Sequence[int]) -> Update:
    """Make a proven subscriber's held fires due now."""
    return (update(messages).where(messages.c.held, messages.c.subscriber_ref.in_(list(subscriber_refs)),
                                   messages.c.state == "pending")
            .values(held=False, next_attempt_at=db_now()))


def fail_held(subscriber_refs: Sequence[int], why: str) -> Update:
    """End the held fires of subscribers whose URL was never proven: dead ``proof_failed``."""
    return (update(messages).where(messages.c.held, messages.c.subscriber_ref.in_(list(subscriber_refs)),
                                   messages.c.state == "pending")
            .values(held=False, state="dead", dead_reason="proof_failed", finished_at=db_now(), last_error=why))


def sending_to(subscriber_refs: Sequence[int]) -> Select[Any]:
    """Which of ``subscriber_refs`` may still be sent fires: registered (a removed subscriber's
    row is gone) and not paused."""
    return select(subscribers.c.id).where(subscribers.c.id.in_(list(subscriber_refs)), subscribers.c.state != "paused")


def cancel_pending(subscriber_refs: Sequence[int], why: str) -> Update:
    """End every unsent fire of revoked subscribers: dead ``cancelled`` (nothing more is sent)."""
    return (update(messages).where(messages.c.subscriber_ref.in_(list(subscriber_refs)), messages.c.state == "pending")
            .values(held=False, state="dead", dead_reason="cancelled", finished_at=db_now(), last_error=why))


def _cancel_proof(connection: Connection, row: Any, why: str) -> None:
    """A pending proof that no longer matters: its held fires and its unsent challenge end."""
    connection.execute(fail_held([row.id], why))
    if row.challenge_message_id is not None:
        connection.execute(update(messages).where(messages.c.id == row.challenge_message_id,
                                                  messages.c.state == "pending")
                           .values(state="dead", dead_reason="proof_failed", finished_at=db_now(), last_error=why))


def _proof_ended(connection: Connection, row: Any) -> bool:
    """Whether a ``pending_proof`` row's challenge is over (delivered, dead or purged) although
    the row was never settled."""
    if row.state != "pending_proof" or row.challenge_message_id is None:
        return False
    state = connection.execute(select(messages.c.state).where(messages.c.id == row.challenge_message_id)).scalar()
    return state not in ("pending", "in_flight")


def _seller_agent_url(settings: Settings) -> str:
    """The seller agent's URL (checked with the settings); its absence, refused here."""
    if settings.seller_agent_url is None:
        raise ConfigurationError("OUTBOX_SELLER_AGENT_URL must be the seller agent's absolute URL: every "
                                 "webhook.challenge names it (notification configs need a URL proof)")
    return settings.seller_agent_url


def _queue_challenge(connection: Connection, *, row_id: int, tenant: str, account: str, subscriber_id: str,
                     events: list[str], registration: _Registration, owner: str | None, agent_url: str,
                     settings: Settings) -> int:
    """Insert the ``webhook.challenge`` POST (webhook-challenge.json) for ``outboxd`` to send.

    Always RFC 9421-signed, whatever auth the subscriber selected: ``delivery_auth`` only
    announces the mode later fires will use.
    """
    delivery_auth: dict[str, str] = {"mode": protocol.DELIVERY_AUTH_MODES[registration.auth_mode]}
    if registration.credentials is not None:
        delivery_auth["credential_fingerprint"] = _fingerprint(registration.credentials) or ""
    content = {
        "type": protocol.CHALLENGE_TYPE, "challenge": secrets.token_urlsafe(32), "account_id": account,
        "subscriber_id": subscriber_id, "seller_agent_url": agent_url,
        "delivery_auth": delivery_auth, "event_types": events,
    }
    proof = _Registration(registration.url, None, None, "rfc9421", None)
    columns = {"notification_type": protocol.CHALLENGE_TYPE, "account_id": account,
               "subscriber_id": subscriber_id, "subscriber_ref": row_id, "principal_id": owner}
    row = _row(tenant, proof, f"whk_{uuid.uuid4()}", _render(content), content, settings, columns)
    return store_bound(connection, row, producer_keys(connection, settings)).id


def _key(tenant: str, account: str, subscriber_id: str) -> Any:
    return ((subscribers.c.tenant_id == tenant) & (subscribers.c.account_id == account)
            & (subscribers.c.subscriber_id == subscriber_id))


# The first registration of an entry has no row to lock: on PostgreSQL the key itself is
# locked (a transaction-level advisory lock, safe behind a transaction pooler), so a second,
# concurrent first registration waits for the first to commit and then finds its row,
# instead of colliding on the unique key. The two-integer form keeps outboxd's locks apart
# from any a seller takes with a single bigint.
_LOCK_KEY = text("SELECT pg_advisory_xact_lock(hashtext('outbox_subscribers'), hashtext(:key))")


def _locked(connection: Connection, tenant: str, account: str, subscriber_id: str) -> Any:
    """The entry's row, locked until the transaction ends (``None`` when there is none yet)."""
    query = select(subscribers).where(_key(tenant, account, subscriber_id))
    if connection.dialect.name != "postgresql":  # SQLite: the writer's BEGIN IMMEDIATE serializes
        return connection.execute(query).first()
    row = connection.execute(query.with_for_update()).first()
    if row is None:
        connection.execute(_LOCK_KEY, {"key": json.dumps([tenant, account, subscriber_id])})
        row = connection.execute(query.with_for_update()).first()
    return row


def register_subscriber(
    conn: Conn,
    *,
    tenant_id: str,
    account_id: str,
    notification_config: Any,
    principal_id: str | None = None,
    settings: Settings | None = None,
) -> Subscriber:
    """Upsert one ``notification_configs[]`` entry by (tenant, account, subscriber_id).

    Validated like enqueue (URL rules, ``event_types`` against the account-anchored enum,
    legacy credentials sealed). An unchanged entry changes nothing. A new or changed URL,
    event set or auth on an active entry needs a fresh proof (state ``pending_proof``);
    a paused entry (``active: false``) is stored and never fired to (pausing ends its unsent
    fires dead ``cancelled``). Re-activating a
    configuration whose proof already succeeded needs no new proof; re-sending one whose
    proof failed tries the proof again.
    """
    settings = settings or default_settings()
    tenant = _tenant(tenant_id)
    account = check_string(account_id, "account_id")
    owner = principal(principal_id)
    subscriber_id, events, active, registration = _validated(notification_config, settings)
    digest = _config_digest(registration, events)
    connection = _connection(conn)
    row = _locked(connection, tenant, account, subscriber_id)
    unchanged = row is not None and (row.config_sha256, bool(row.active), row.principal_id) == (digest, active, owner)
    # The same configuration waiting on a proof that ended unsettled (a database an older
    # release left so): proven again, and its held fires wait for the new proof.
    renew = row is not None and row.config_sha256 == digest and _proof_ended(connection, row)
    if unchanged and row.state != "proof_failed" and not renew:  # a failed proof is tried again when re-sent
        return _record(row)
    if not active:
        state = "paused"
    elif row is not None and row.proven_sha256 == digest:
        state = "active"
    else:
        state = "pending_proof"
    keep_proof = (row is not None and row.state == "pending_proof" == state and row.config_sha256 == digest
                  and not renew)
    new_proof = state == "pending_proof" and not keep_proof
    agent_url = _seller_agent_url(settings) if new_proof else None  # every check before the first write
    secret = None
    if registration.credentials is not None:
        secret = seal_credential(producer_keys(connection, settings), tenant, account, subscriber_id,
                                 registration.credentials)
    if row is not None and row.state == "pending_proof" and not keep_proof and not (renew and new_proof):
        _cancel_proof(connection, row, "subscriber changed before its URL proof completed")
    if row is not None and state == "paused":  # paused is revoked: nothing more is sent
        connection.execute(cancel_pending([row.id], "subscriber paused"))
    values = {"principal_id": owner, "url": registration.url, "event_types": json.dumps(events),
              "auth_mode": registration.auth_mode, "auth_secret": secret, "active": active, "state": state,
              "config_sha256": digest}
    if row is None:
        row_id = connection.execute(subscribers.insert().values(
            tenant_id=tenant, account_id=account, subscriber_id=subscriber_id, **values)
            .returning(subscribers.c.id)).scalar_one()
    else:
        row_id = row.id
        connection.execute(update(subscribers).where(subscribers.c.id == row_id).values(**values, updated_at=db_now()))
    if agent_url is not None:
        challenge = _queue_challenge(connection, row_id=row_id, tenant=tenant, account=account,
                                     subscriber_id=subscriber_id, events=events, registration=registration,
                                     owner=owner, agent_url=agent_url, settings=settings)
        connection.execute(update(subscribers).where(subscribers.c.id == row_id)
                           .values(challenge_message_id=challenge))
    return _record(connection.execute(select(subscribers).where(subscribers.c.id == row_id)).one())


def list_subscribers(conn: Conn, *, tenant_id: str, account_id: str | None = None) -> list[Subscriber]:
    """A tenant's subscribers (one account's when ``account_id`` is given), without credentials."""
    query = select(subscribers).where(subscribers.c.tenant_id == _tenant(tenant_id))
    if account_id is not None:
        query = query.where(subscribers.c.account_id == check_string(account_id, "account_id"))
    rows = _connection(conn).execute(query.order_by(subscribers.c.account_id, subscribers.c.subscriber_id))
    return [_record(r) for r in rows]


def remove_subscriber(conn: Conn, *, tenant_id: str, account_id: str, subscriber_id: str) -> bool:
    """Delete a subscriber (dropped from ``notification_configs[]``); ``False`` if there was none.

    Fires still held for its unfinished proof end dead ``proof_failed``; its other unsent
    fires end dead ``cancelled``: a revoked subscription is sent nothing more.
    """
    connection = _connection(conn)
    tenant, account = _tenant(tenant_id), check_string(account_id, "account_id")
    row = _locked(connection, tenant, account, check_string(subscriber_id, "subscriber_id"))
    if row is None:
        return False
    if row.state == "pending_proof":
        _cancel_proof(connection, row, "subscriber removed before its URL proof completed")
    connection.execute(cancel_pending([row.id], "subscriber removed"))
    connection.execute(delete(subscribers).where(subscribers.c.id == row.id))
    return True
