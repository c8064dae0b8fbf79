"""outboxd's subscribers as the ``adcp`` SDK's reporting subscription resolver.

The SDK's expansion asks a ``ReportingSubscriptionResolver`` which subscriptions an event
goes to. :class:`OutboxSubscriptionResolver` answers from outboxd's own subscriber table,
so there is one registry: what ``register_subscriber`` stored, proven by outboxd's
``webhook.challenge``, and revoked by ``remove_subscriber`` or a pause. Only proven
(``active``) subscribers that a principal registered are returned; the SDK then scopes
each event to its consumer principal.

The hand-off sends to the URL outboxd proved, never to the SDK's copy. The SDK accepts
only ``https`` URLs on port 443 in a subscription, so the subscription names the
subscriber by a reference URL (:func:`reference_url`) that nothing ever connects to.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from sqlalchemy import Engine, select

from outbox.config import Settings
from outbox.events import _credentials
from outbox.producer import default_settings
from outbox.protocol import DELIVERY_AUTH_MODES, PRINCIPAL_SCOPED_TYPES
from outbox.schema import subscribers


def reference_url(row: Any) -> str:
    """The subscriber's stand-in URL in the SDK's sealed delivery (``.invalid``: RFC 2606)."""
    return f"https://outboxd.invalid/subscribers/{row.id}"


class OutboxSubscriptionResolver:
    """An SDK ``ReportingSubscriptionResolver`` over one tenant's outboxd subscribers."""

    def __init__(self, engine: Engine, tenant_id: str, settings: Settings | None = None) -> None:
        self.engine, self.tenant_id = engine, tenant_id
        self.settings = settings or default_settings()

    def _subscription(self, row: Any) -> Any:
        from adcp.reporting.outbox import ReportingLegacyAuthentication, ReportingNotificationSubscription

        events = tuple(t for t in json.loads(row.event_types) if t in PRINCIPAL_SCOPED_TYPES)
        legacy = row.auth_mode != "rfc9421"
        authentication = (ReportingLegacyAuthentication(DELIVERY_AUTH_MODES[row.auth_mode],  # type: ignore[arg-type]
                                                        _credentials(row, self.settings) or "")
                          if legacy else None)
        return ReportingNotificationSubscription(
            row.account_id, row.subscriber_id, row.principal_id, reference_url(row), events,
            configuration_revision=row.config_sha256, authorization_ref=f"principal.{row.id}",
            proof_of_control_ref=row.proven_sha256, authentication=authentication,
            signing_scope_id=None if legacy else self.tenant_id,  # signed with the tenant's keyring
            active=True, authorized=True, proof_valid=True)

    def _rows(self, account_id: str, subscriber_id: str | None) -> list[Any]:
        query = select(subscribers).where(subscribers.c.tenant_id == self.tenant_id,
                                          subscribers.c.account_id == account_id, subscribers.c.state == "active",
                                          subscribers.c.principal_id.is_not(None),
                                          subscribers.c.proven_sha256 == subscribers.c.config_sha256)
        if subscriber_id is not None:
            query = query.where(subscribers.c.subscriber_id == subscriber_id)
        with self.engine.connect() as conn:
            return list(conn.execute(query.order_by(subscribers.c.subscriber_id)))

    def _matching(self, account_id: str, notification_type: str, subscriber_id: str | None) -> tuple[Any, ...]:
        rows = self._rows(account_id, subscriber_id)
        return tuple(self._subscription(r) for r in rows if notification_type in json.loads(r.event_types))

    async def list_active(self, *, account_id: str, notification_type: str) -> tuple[Any, ...]:
        """Every proven subscriber of the account to this type (the SDK filters by principal)."""
        return await asyncio.to_thread(self._matching, account_id, notification_type, None)

    async def get_active(self, *, account_id: str, subscriber_id: str, notification_type: str) -> Any:
        """The subscriber as it is now, or ``None`` once it is gone, paused or unsubscribed."""
        found = await asyncio.to_thread(self._matching, account_id, notification_type, subscriber_id)
        return found[0] if found else None
