"""docs/sdk.md, "With the adcp SDK", and ``OutboxWebhookSupervisor`` as it documents it.

Each python block of the section is either an excerpt of docs/examples/adcp_seller.py
(which tests/test_adcp_seller.py runs end to end), checked here to match it line for line,
or runs here as written.
"""

from __future__ import annotations

import asyncio
import json
import re
import textwrap
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from adcp.types import CreateMediaBuySuccessResponse, McpWebhookPayload, Package
from sqlalchemy import select

from outbox.db import make_async_engine
from outbox.schema import messages
from tests.adcp_schema import assert_valid

ROOT = Path(__file__).resolve().parent.parent
CONFIRMED = datetime(2026, 12, 1, tzinfo=timezone.utc)
EXAMPLE = (ROOT / "docs" / "examples" / "adcp_seller.py").read_text().splitlines()


def sdk_section() -> str:
    return (ROOT / "docs" / "sdk.md").read_text()


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", sdk_section(), flags=re.S)


def excerpt_of_example(block: str) -> bool:
    """``block`` equals consecutive lines of the example, at one common indentation."""
    lines = block.rstrip("\n").splitlines()
    for start, first in enumerate(EXAMPLE):
        indent = first[: len(first) - len(first.lstrip())]
        window = EXAMPLE[start:start + len(lines)]
        if len(window) == len(lines) and all(w == (indent + line if line else "") for w, line in
                                             zip(window, textwrap.dedent(block).splitlines())):
            return True
    return False


def test_the_section_shows_the_example_and_how_to_start_it():
    blocks = python_blocks()
    assert len(blocks) >= 5
    assert "python docs/examples/adcp_seller.py --port 3001" in sdk_section()
    assert "adcp==9.2.0" in (ROOT / "pyproject.toml").read_text() and "adcp==9.2.0" in sdk_section()
    for block in blocks:  # excerpts of a method body compile inside a coroutine
        compile("async def excerpt():\n" + textwrap.indent(textwrap.dedent(block), "    "), "docs/sdk.md", "exec")
    standalone = [b for b in blocks if not excerpt_of_example(b)]
    assert len(standalone) == 1 and "OutboxWebhookSupervisor" in standalone[0], standalone


def test_excerpt_check_catches_an_edited_snippet():
    block = next(b for b in python_blocks() if "enqueue_task_webhook" in b)
    assert excerpt_of_example(block)
    assert not excerpt_of_example(block.replace('status="completed"', 'status="working"'))


def _run_readme_supervisor_snippet(async_engine: Any) -> Any:
    (snippet,) = [b for b in python_blocks() if not excerpt_of_example(b)]
    namespace: dict[str, Any] = {"async_engine": async_engine}
    exec(snippet, namespace)  # as written in docs/sdk.md
    return namespace["webhook_supervisor"]


def test_outbox_webhook_supervisor_enqueues_sdk_models_durably(engine):
    """``send_mcp`` with the SDK's own types commits one pending message per call."""
    from adcp.types import GeneratedTaskStatus, TaskType

    async def scenario() -> None:
        async_engine = make_async_engine(engine.url)
        supervisor_ = _run_readme_supervisor_snippet(async_engine)
        assert supervisor_.delivery_state_is_durable is True
        result = CreateMediaBuySuccessResponse(media_buy_id="mb_1", revision=1, confirmed_at=CONFIRMED,
                                               packages=[Package(package_id="pkg_1")])
        assert await supervisor_.send_mcp(
            url="https://buyer.example.com/hooks", task_id="task_1", status=GeneratedTaskStatus.completed,
            task_type=TaskType.create_media_buy, result=result, operation_id="op_1",
            token="tok_abcdefghijklmnop") is None
        for period in ("2026-11-01", "2026-11-02"):
            await supervisor_.send_mcp(
                url="https://buyer.example.com/reports", task_id="mb_1", status="completed",
                task_type="media_buy_delivery", operation_id="op_rep", sequence_key="acme:mb_1",
                result={"notification_type": "scheduled", "currency": "USD", "media_buy_deliveries": [],
                        "reporting_period": {"start": f"{period}T00:00:00Z", "end": f"{period}T23:59:59Z"}})
        await async_engine.dispose()

    asyncio.run(scenario())
    with engine.connect() as conn:  # committed: visible from another connection
        rows = conn.execute(select(messages).order_by(messages.c.id)).all()
    assert [(r.tenant_id, r.task_type, r.state) for r in rows] == \
        [("acme", "create_media_buy", "pending")] + [("acme", "media_buy_delivery", "pending")] * 2
    body = json.loads(rows[0].body)
    assert body["status"] == "completed" and body["token"] == "tok_abcdefghijklmnop"
    assert CreateMediaBuySuccessResponse.model_validate(body["result"]) == CreateMediaBuySuccessResponse(
        media_buy_id="mb_1", revision=1, confirmed_at=CONFIRMED, packages=[Package(package_id="pkg_1")])
    McpWebhookPayload.model_validate(body)
    assert_valid(bytes(rows[0].body))
    assert [json.loads(r.body)["result"]["sequence_number"] for r in rows[1:]] == [1, 2]


def test_the_sdk_refuses_it_as_its_webhook_supervisor(sqlite_url):
    """Why docs/sdk.md says "cannot be the SDK's webhook_supervisor": adcp 9.2.0's own boot check, run for real."""
    from adcp.decisioning import AdcpError, DecisioningCapabilities, DecisioningPlatform, SingletonAccounts
    from adcp.decisioning import create_adcp_server_from_platform
    from adcp.decisioning.capabilities import WebhookSigning

    from supervisor.sdk import OutboxWebhookSupervisor

    class Seller(DecisioningPlatform):
        capabilities = DecisioningCapabilities(
            specialisms=["sales-non-guaranteed"],
            webhook_signing=WebhookSigning(supported=True, profile="adcp/webhook-signing/v1",
                                           algorithms=["ed25519"], delivery_retry_horizon_seconds=86_400),
            webhook_signing_managed_externally=True)
        accounts = SingletonAccounts(account_id="acme")

        def get_products(self, *args: Any) -> None: ...

        create_media_buy = update_media_buy = sync_creatives = get_media_buy_delivery = get_products

    async_engine = make_async_engine(sqlite_url)
    with pytest.raises(AdcpError, match="must not wire an SDK webhook_sender or webhook_supervisor"):
        create_adcp_server_from_platform(
            Seller(), auto_emit_task_webhooks=False, validate_at_init=False,
            webhook_supervisor=OutboxWebhookSupervisor(async_engine, tenant_id="acme"))
