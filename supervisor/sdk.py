"""A ``send_mcp``-compatible enqueuer for seller code that calls ``send_mcp`` itself.

The ``adcp`` SDK's ``WebhookDeliverySupervisor`` retries, breaks circuits and numbers
delivery reports in process memory (``delivery_state_is_durable = False``). Code that calls
its ``send_mcp(...)`` directly can call :class:`OutboxWebhookSupervisor` instead: the same
keyword arguments, but the call only enqueues into the outbox (durably, in its own
transaction) and ``outboxd`` signs, sends and retries.

It is NOT pluggable as the SDK's ``webhook_supervisor=`` in adcp 9.2.0: the framework's
boot check (``adcp.decisioning.webhook_emit.validate_webhook_signing_for_capabilities``)
refuses any SDK ``webhook_supervisor`` next to ``webhook_signing_managed_externally=True``,
and without external management it demands the SDK's own ``PgTaskWebhookOutbox`` when
``webhook_signing.supported`` is advertised, and otherwise rejects every push-configured
task at request time (``_validate_handoff_push_ownership``). For task webhooks, enqueue
inside the seller's transaction instead (docs/sdk.md).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import aio, protocol
from outbox.config import Settings
from outbox.producer import default_settings


def _text(value: Any) -> str:
    return str(getattr(value, "value", value))


class OutboxWebhookSupervisor:
    """``WebhookDeliverySupervisor.send_mcp`` with durable enqueue: not atomic, but never lost."""

    delivery_state_is_durable = True

    def __init__(self, engine: AsyncEngine, *, tenant_id: str, settings: Settings | None = None) -> None:
        self._engine = engine
        self._tenant_id = tenant_id
        self._settings = settings or default_settings()
        self.delivery_retry_horizon_seconds: int | None = self._settings.retry_horizon_seconds

    async def send_mcp(
        self,
        *,
        url: str,
        task_id: str,
        status: Any,
        task_type: Any,
        result: Any = None,
        operation_id: str,
        token: str | None = None,
        sequence_key: str | None = None,
        breaker_key: str | None = None,  # breakers are keyed by tenant and endpoint origin
        notification_type: str | None = None,
    ) -> None:
        """Enqueue durably and return ``None``: delivery happens in ``outboxd``.

        Delivery reports (``media_buy_delivery`` with a ``sequence_key``) get their
        ``sequence_number`` from the outbox's durable counter for that stream, scoped by this
        supervisor's tenant: two tenants passing one ``sequence_key`` count independently.
        """
        registration = {"url": url, "operation_id": operation_id, **({"token": token} if token else {})}
        async with self._engine.begin() as conn:
            if _text(task_type) == protocol.DELIVERY_TASK_TYPE and sequence_key and result is not None:
                await aio.enqueue_delivery_report(
                    conn, tenant_id=self._tenant_id, reporting_webhook=registration, media_buy_id=task_id,
                    result=result, stream_key=sequence_key, settings=self._settings)
            else:
                await aio.enqueue_task_webhook(
                    conn, tenant_id=self._tenant_id, push_notification_config=registration, task_id=task_id,
                    task_type=_text(task_type), status=_text(status), result=result, settings=self._settings)
        return None
