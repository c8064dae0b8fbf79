"""The seam to the ``adcp`` SDK: a durable ``WebhookDeliverySupervisor``.

The SDK's reference supervisor keeps retries, breakers and sequence counters in process
memory (``delivery_state_is_durable = False``). This class has the same ``send_mcp`` shape
but only enqueues into the outbox, durably; ``outboxd`` does the signing, sending and
retrying. A seller switches with one line::

    supervisor = OutboxWebhookSupervisor(async_engine, tenant_id="acme")

For the atomic AdCP 3.2 contract, prefer ``outbox.aio.enqueue_task_webhook`` inside the
transaction that moves the task, with ``webhook_signing_managed_externally=True`` (README).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import aio, protocol
from outbox.config import Settings
from outbox.producer import default_settings


def _text(value: Any) -> str:
    return str(getattr(value, "value", value))


class OutboxWebhookSupervisor:
    """``adcp.webhook_supervisor.WebhookDeliverySupervisor`` backed by the outbox tables."""

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
            if _text(task_type) == protocol.DELIVERY_TASK_TYPE and sequence_key and isinstance(result, Mapping):
                await aio.enqueue_delivery_report(
                    conn, tenant_id=self._tenant_id, reporting_webhook=registration, media_buy_id=task_id,
                    result=dict(result), stream_key=sequence_key, settings=self._settings)
            else:
                await aio.enqueue_task_webhook(
                    conn, tenant_id=self._tenant_id, push_notification_config=registration, task_id=task_id,
                    task_type=_text(task_type), status=_text(status), result=result, settings=self._settings)
        return None
