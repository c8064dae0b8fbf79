"""An AdCP seller on the ``adcp`` SDK's framework whose task webhooks ``outboxd`` delivers.

Started by one command (docs/sdk.md), with the same ``OUTBOX_*`` variables
the daemon reads, so both agree on the database, the signing key and the retry horizon::

    python docs/examples/adcp_seller.py --port 3001

It serves AdCP over MCP on 127.0.0.1. ``create_media_buy`` hands off to a task; the task
stores the media buy and enqueues its terminal webhook in one database transaction, so the
webhook exists if and only if the media buy does. ``outboxd run`` signs and delivers it.
The public JWKS is served at ``/outboxd/jwks.json`` (the SDK reserves ``/.well-known``).
"""

from __future__ import annotations

import argparse
import functools
import uuid
from datetime import datetime, timezone
from typing import Any, NoReturn

from adcp.decisioning import (
    AdcpError, DecisioningCapabilities, DecisioningPlatform, SingletonAccounts, TaskHandoffContext, serve)
from adcp.decisioning.capabilities import (
    Account, Adcp, IdempotencyUnsupported, MediaBuy, SupportedProtocol, WebhookSigning)
from adcp.types import CreateMediaBuyErrorResponse, CreateMediaBuySuccessResponse, Error, Package
from sqlalchemy import CheckConstraint, Column, Float, Integer, MetaData, String, Table, insert, select, update
from sqlalchemy.exc import IntegrityError
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import outbox
from outbox import aio, protocol
from outbox.db import make_async_engine, make_engine
from outbox.migrate import upgrade
from supervisor.keys import keyring

SETTINGS = outbox.load_settings()  # the daemon's settings: same database, key and horizon
TENANT = "example-seller"  # the outbox tenant: breakers and signing keys are per tenant
JWKS_PATH = "/outboxd/jwks.json"
INVENTORY_BUDGET = 100_000.0  # what this seller can still sell, in total

tables = MetaData()
media_buys = Table(
    "media_buys", tables,
    Column("media_buy_id", String(64), primary_key=True),
    Column("task_id", String(64), nullable=False, unique=True),
    Column("total_budget", Float, nullable=False),
    Column("status", String(32), nullable=False),
)
inventory = Table(
    "inventory", tables,
    Column("id", Integer, primary_key=True),
    Column("remaining_budget", Float, CheckConstraint("remaining_budget >= 0"), nullable=False),
)
engine = make_async_engine(SETTINGS.database_url)


async def jwks_document() -> dict[str, Any]:
    """The JWKS to publish: the keyring's, as ``outboxd keys jwks`` prints it."""
    async with engine.connect() as conn:
        snapshot = await conn.run_sync(keyring.read_snapshot)
    return keyring.jwks_document(snapshot.records, snapshot.now)


async def serve_jwks(request: Request) -> JSONResponse:
    return JSONResponse(await jwks_document(), headers={"Cache-Control": "max-age=300"})


class ExampleSeller(DecisioningPlatform):
    capabilities = DecisioningCapabilities(
        adcp=Adcp(major_versions=[3], idempotency=IdempotencyUnsupported(supported=False)),
        supported_protocols=[SupportedProtocol.media_buy],
        specialisms=["sales-non-guaranteed"],
        account=Account(supported_billing=["operator"]),
        media_buy=MediaBuy(supported_pricing_models=["cpm"]),
        webhook_signing=WebhookSigning(
            supported=True,
            profile="adcp/webhook-signing/v1",
            algorithms=["ed25519"],
            legacy_hmac_fallback=False,
            delivery_retry_horizon_seconds=SETTINGS.retry_horizon_seconds,  # what outboxd honours
        ),
        webhook_signing_managed_externally=True,  # outboxd signs and delivers, not the SDK
    )
    accounts = SingletonAccounts(account_id=TENANT)

    def create_media_buy(self, req: Any, ctx: Any) -> Any:
        # AdCP 3.2: an inline terminal result must not be followed by a task webhook, so
        # the webhook belongs to a task, with the task id the SDK issues.
        served_as = ctx.resolved_adcp_version
        registration = req.push_notification_config
        if registration is not None and registration.operation_id is None \
                and not protocol.requires_operation_id(served_as):
            # An AdCP 3.0 buyer: 3.0 has no push_notification_config.operation_id, so its
            # webhook carries none (never one parsed from the URL). The SDK refuses any task
            # registration without one (the 3.1+ rule), so this seller keeps the
            # registration to itself; a 3.1+ buyer without operation_id is still refused.
            req.push_notification_config = None
        return ctx.handoff_to_task(functools.partial(self.book, req, registration, served_as))

    async def book(self, req: Any, registration: Any, served_as: str | None,
                   task: TaskHandoffContext) -> CreateMediaBuySuccessResponse:
        """The task: store the media buy and enqueue its terminal webhook in one transaction."""
        task_id = task.id  # issued by the SDK; the buyer polls and correlates with it
        budget = req.total_budget.amount if req.total_budget else 0.0
        result = CreateMediaBuySuccessResponse(
            media_buy_id=f"mb_{uuid.uuid4().hex[:12]}",
            confirmed_at=datetime.now(timezone.utc),
            revision=1,
            packages=[Package(package_id=f"pkg_{i}", product_id=p.product_id, budget=p.budget)
                      for i, p in enumerate(req.packages or [])],
        )
        try:
            async with engine.begin() as conn:
                await conn.execute(insert(media_buys).values(
                    media_buy_id=result.media_buy_id, task_id=task_id, total_budget=budget, status="active"))
                if registration is not None:
                    await aio.enqueue_task_webhook(
                        conn, tenant_id=TENANT, push_notification_config=registration, adcp_version=served_as,
                        task_id=task_id, task_type="create_media_buy", status="completed",
                        result=result, context=req.context)
                # Anything that fails before the commit, here the inventory CHECK, rolls
                # back the media buy and its webhook together.
                await conn.execute(update(inventory).values(
                    remaining_budget=inventory.c.remaining_budget - budget))
        except IntegrityError:
            await self.fail(req, registration, served_as, task_id, "the budget exceeds the remaining inventory")
        return result

    async def fail(self, req: Any, registration: Any, served_as: str | None, task_id: str,
                   message: str) -> NoReturn:
        """The buyer asked for a webhook: the failure is terminal, so it gets one too."""
        if registration is not None:
            async with engine.begin() as conn:
                await aio.enqueue_task_webhook(
                    conn, tenant_id=TENANT, push_notification_config=registration, adcp_version=served_as,
                    task_id=task_id, task_type="create_media_buy", status="failed", context=req.context,
                    result=CreateMediaBuyErrorResponse(errors=[Error(code="BUDGET_EXCEEDED", message=message)]))
        raise AdcpError("BUDGET_EXCEEDED", message=message, recovery="correctable")

    def unsupported(self, *args: Any) -> NoReturn:
        raise AdcpError("UNSUPPORTED_FEATURE", message="this example seller only books media buys")

    # The rest of the sales-non-guaranteed surface, which the SDK requires to exist.
    get_products = update_media_buy = sync_creatives = get_media_buy_delivery = unsupported


def prepare_database() -> None:
    """The outbox tables (``outboxd migrate``), the seller's tables, and its inventory."""
    sync_engine = make_engine(SETTINGS.database_url)
    upgrade(sync_engine)
    tables.create_all(sync_engine)
    with sync_engine.begin() as conn:
        if conn.execute(select(inventory.c.id)).first() is None:
            conn.execute(insert(inventory).values(id=1, remaining_budget=INVENTORY_BUDGET))
    sync_engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=3001)
    args = parser.parse_args()
    prepare_database()
    serve(ExampleSeller(), name="example-seller", host="127.0.0.1", port=args.port,
          auto_emit_task_webhooks=False, unauthenticated_routes=[Route(JWKS_PATH, serve_jwks)])


if __name__ == "__main__":
    main()
