"""The enqueue API takes the ``adcp`` SDK's own (pydantic) models wherever it takes a mapping.

The oracle is the SDK itself: what is stored must parse back, with the SDK's model, into
the model that was passed, and the body must validate against the AdCP 3.2 schema.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
from adcp.types import (
    CreateMediaBuyErrorResponse,
    CreateMediaBuySuccessResponse,
    Error,
    McpWebhookPayload,
    Package,
    PushNotificationConfig,
)
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from sqlalchemy import select

import outbox
from outbox.schema import messages
from outbox.sealing import plaintext
from tests.adcp_schema import assert_valid

PNC = PushNotificationConfig(url="https://buyer.example.com/hooks", operation_id="op_1",
                             token="tok_abcdefghijklmnop")
_ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=24)
_packages = st.lists(st.builds(Package, package_id=_ids, product_id=_ids,
                               budget=st.floats(min_value=0, max_value=1e9, allow_nan=False)), max_size=4)
_success = st.builds(
    CreateMediaBuySuccessResponse, media_buy_id=_ids, packages=_packages,
    revision=st.integers(min_value=1, max_value=2**31),
    confirmed_at=st.datetimes(timezones=st.just(timezone.utc)),
    message=st.none() | st.text(max_size=40),
)


def _stored(conn, record, settings) -> dict:
    """The body as sent, read in the caller's transaction (opened when sealed)."""
    row = conn.execute(select(messages).where(messages.c.id == record.id)).one()
    return json.loads(plaintext(row, settings.sealing()))


@hsettings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(result=_success)
def test_task_webhook_result_round_trips_through_the_sdk_model(engine, settings, result):
    with engine.connect() as conn, conn.begin() as txn:
        record = outbox.enqueue_task_webhook(
            conn, tenant_id="t1", push_notification_config=PNC, task_id="task_1", task_type="create_media_buy",
            status="completed", result=result, settings=settings)
        body = _stored(conn, record, settings)
        txn.rollback()
    assert CreateMediaBuySuccessResponse.model_validate(body["result"]) == result
    assert body["operation_id"] == "op_1" and body["token"] == PNC.token
    assert_valid(json.dumps(body).encode())


def test_models_nested_in_plain_mappings_and_error_results(engine, settings):
    package = Package(package_id="pkg_1", product_id="prod_1", budget=10.0)
    failed = CreateMediaBuyErrorResponse(errors=[Error(code="BUDGET_EXCEEDED", message="over the inventory")])
    with engine.connect() as conn, conn.begin():
        nested = outbox.enqueue_task_webhook(
            conn, tenant_id="t1", push_notification_config=PNC, task_id="task_1", task_type="create_media_buy",
            status="completed", settings=settings,
            result={"media_buy_id": "mb_1", "revision": 1, "confirmed_at": None, "packages": [package]})
        error = outbox.enqueue_task_webhook(
            conn, tenant_id="t1", push_notification_config=PNC, task_id="task_2", task_type="create_media_buy",
            status="failed", result=failed, settings=settings)
        bodies = _stored(conn, nested, settings), _stored(conn, error, settings)
    assert [Package.model_validate(p) for p in bodies[0]["result"]["packages"]] == [package]
    assert bodies[0]["result"]["media_buy_id"] == "mb_1"
    assert CreateMediaBuyErrorResponse.model_validate(bodies[1]["result"]) == failed
    for body in bodies:
        assert_valid(json.dumps(body).encode())


def test_enqueue_takes_an_sdk_payload_model(engine, settings):
    payload = McpWebhookPayload(idempotency_key="whk_0123456789abcdef", operation_id="op_1", task_id="task_9",
                                task_type="create_media_buy", status="working",
                                timestamp=datetime(2026, 12, 1, tzinfo=timezone.utc))
    with engine.connect() as conn, conn.begin():
        record = outbox.enqueue(conn, tenant_id="t1", url="https://buyer.example.com/hooks", payload=payload,
                                settings=settings)
        body = _stored(conn, record, settings)
    assert record.idempotency_key == "whk_0123456789abcdef"
    assert McpWebhookPayload.model_validate(body) == payload
    assert_valid(json.dumps(body).encode())


def test_a_value_that_is_neither_json_nor_a_model_is_still_refused(engine, settings):
    with engine.connect() as conn, conn.begin():
        with pytest.raises(outbox.OutboxValidationError, match=r"^result.media_buy_id: 'object' is not a JSON type"):
            outbox.enqueue_task_webhook(
                conn, tenant_id="t1", push_notification_config=PNC, task_id="task_1", task_type="create_media_buy",
                status="completed", result={"media_buy_id": object()}, settings=settings)
