"""The producer's limits on identifiers and payloads, alike on PostgreSQL and SQLite: what a
receiver or an index cannot take is refused when enqueued, naming the argument, with nothing
written and the seller's transaction still usable."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import func, select, text

import outbox
from outbox.producer import decode_body
from outbox.schema import messages
from outbox.wire import MAX_JSON_DEPTH, json_problem
from tests import stored

PNC = {"url": "https://buyer.example.com/hooks", "operation_id": "op_1", "token": "tok_abcdefghijklmnop"}
REPORTING = {"url": "https://buyer.example.com/reports", "operation_id": "op_rep", "token": "reporttoken123456"}
KEY = "key_limits_0000000001"


def _task(conn: Any, settings: Any, **overrides: Any) -> outbox.EnqueuedMessage:
    kwargs = dict(tenant_id="t1", push_notification_config=PNC, task_id="task_1", task_type="create_media_buy",
                  status="completed", result={"media_buy_id": "mb_1"}, settings=settings)
    return outbox.enqueue_task_webhook(conn, **{**kwargs, **overrides})


def _report(conn: Any, settings: Any, **overrides: Any) -> outbox.EnqueuedMessage:
    kwargs = dict(tenant_id="t1", reporting_webhook=REPORTING, media_buy_id="mb_1",
                  result={"notification_type": "scheduled", "media_buy_deliveries": []}, settings=settings)
    return outbox.enqueue_delivery_report(conn, **{**kwargs, **overrides})


def _subscriber(conn: Any, settings: Any, **overrides: Any) -> Any:
    config = {"subscriber_id": "sub_1", "url": "https://buyer.example.com/events",
              "event_types": ["account.status_changed"]}
    return outbox.register_subscriber(conn, **{"tenant_id": "t1", "account_id": "acct_1",
                                               "notification_config": config, "principal_id": "p1",
                                               "settings": settings, **overrides})


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for level in range(depth):
        value = {"n": value} if level % 2 else [value]
    return value


def _count(conn: Any) -> int:
    return conn.execute(select(func.count()).select_from(messages)).scalar_one()


TOO_LONG = "\u00e9" * 128  # 128 characters, 256 bytes of UTF-8

REFUSED_IDENTIFIERS = [
    ("tenant_id", _task, dict(tenant_id=TOO_LONG)),
    ("task_id", _task, dict(task_id="t" * 256)),
    ("task_id", _task, dict(task_id="t" * 250)),  # its notification_id, "<task_id>.terminal", would pass 255
    ("principal_id", _task, dict(principal_id=TOO_LONG)),
    ("media_buy_id", _report, dict(media_buy_id="m" * 256)),
    ("stream_key", _report, dict(stream_key=TOO_LONG)),
    ("account_id", _subscriber, dict(account_id="a" * 256)),
]


@pytest.mark.parametrize(("field", "call", "overrides"), REFUSED_IDENTIFIERS,
                         ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(REFUSED_IDENTIFIERS)])
def test_an_identifier_over_255_bytes_is_refused_and_the_transaction_lives_on(engine, settings, field, call,
                                                                               overrides):
    with engine.begin() as conn:
        with pytest.raises(outbox.OutboxValidationError) as caught:
            call(conn, settings, **overrides)
        assert caught.value.field == field
        assert conn.execute(text("SELECT 1")).scalar_one() == 1  # PostgreSQL did not abort it
        assert _count(conn) == 0


def test_identifiers_at_the_limit_with_the_longest_url_are_stored(engine, settings):
    """A default reporting stream's key holds the tenant, the media buy and the URL: at their
    limits it still fits PostgreSQL's bound on an index entry (2,704 bytes)."""
    url = "https://buyer.example.com/" + "r" * (2048 - len("https://buyer.example.com/"))
    tenant, media_buy = "\u00e9" * 127 + "t", "m" * 255  # 255 bytes each
    with engine.begin() as conn:
        report = _report(conn, settings, tenant_id=tenant, media_buy_id=media_buy,
                         reporting_webhook={**REPORTING, "url": url})
        task = _task(conn, settings, tenant_id=tenant, task_id="t" * 246, principal_id="p" * 255,
                     push_notification_config={**PNC, "url": url})
    assert report.sequence_number == 1 and task.id > report.id


REFUSED_PAYLOADS = [
    ("result", "object keys must be strings", dict(result={1: "a", "b": 2})),
    ("result", "object keys must be strings", dict(result={1: "a", "1": "b"})),  # would render a duplicate key
    ("result.packages[0]", "object keys must be strings", dict(result={"packages": [{7: "x"}]})),
    ("context.budget", "'Decimal' is not a JSON type", dict(context={"budget": Decimal("1.50")})),
    ("result.ratio", "not a JSON number", dict(result={"ratio": float("inf")})),
    ("result", f"nests deeper than {MAX_JSON_DEPTH}", dict(result={"deep": _nested(MAX_JSON_DEPTH)})),
]


@pytest.mark.parametrize(("field", "why", "overrides"), REFUSED_PAYLOADS,
                         ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(REFUSED_PAYLOADS)])
def test_a_payload_no_receiver_can_take_is_refused_naming_where(engine, settings, field, why, overrides):
    with engine.begin() as conn:
        with pytest.raises(outbox.OutboxValidationError, match=why) as caught:
            _task(conn, settings, **overrides)
        assert caught.value.field.startswith(field)
        assert _count(conn) == 0


def test_the_deepest_accepted_payload_is_stored_and_reads_back_as_json(engine, settings):
    deepest = _nested(MAX_JSON_DEPTH - 1)  # under the payload's own object
    with engine.begin() as conn:
        record = outbox.enqueue(conn, tenant_id="t1", url=PNC["url"], payload={"deep": deepest}, settings=settings)
    assert decode_body(stored.body(engine, record.id, settings)) == {"deep": deepest, "idempotency_key": record.idempotency_key}


def test_an_enqueue_payload_names_its_own_path(engine, settings):
    with engine.begin() as conn:
        with pytest.raises(outbox.OutboxValidationError, match="not a JSON number") as caught:
            outbox.enqueue(conn, tenant_id="t1", url=PNC["url"], payload={"a": [1, {"b": float("nan")}]},
                           settings=settings)
    assert caught.value.field == "payload.a[1].b"


@pytest.mark.parametrize("body", [
    b'{"idempotency_key":"' + KEY.encode() + b'","x":"\\ud800"}',  # an escaped lone surrogate
    b'{"idempotency_key":"' + KEY.encode() + b'","x":' + b"[" * 70 + b"]" * 70 + b"}",
])
def test_exact_bytes_no_receiver_can_take_are_refused(engine, settings, body):
    with engine.begin() as conn:
        with pytest.raises(outbox.OutboxValidationError) as caught:
            outbox.enqueue(conn, tenant_id="t1", url=PNC["url"], payload=body, settings=settings)
        assert caught.value.field.startswith("payload")
        assert _count(conn) == 0


def test_exact_bytes_with_escaped_text_that_is_valid_unicode_are_kept_exactly(engine, settings):
    body = b'{"idempotency_key":"' + KEY.encode() + b'","x":"\\ud83d\\ude00 \\u00e9"}'
    with engine.begin() as conn:
        record = outbox.enqueue(conn, tenant_id="t1", url=PNC["url"], payload=body, settings=settings)
    assert stored.body(engine, record.id, settings) == body


@pytest.mark.parametrize(("payload", "why"), [
    ({"ratio": float("nan")}, "not a JSON number"),
    ({"amount": Decimal("1")}, "'Decimal' is not a JSON type"),
    ({"blob": "x" * (1024 * 1024)}, "over the 1 MiB limit"),
])
def test_an_event_with_no_subscriber_yet_refuses_what_a_subscriber_would(engine, settings, payload, why):
    """A payload that works in a test with no subscriber must not start failing once a buyer subscribes."""
    with engine.begin() as conn:
        with pytest.raises(outbox.OutboxValidationError, match=why):
            outbox.enqueue_event(conn, tenant_id="t1", account_id="acct_1", notification_type="account.status_changed",
                                 payload=payload, settings=settings)
        assert outbox.enqueue_event(conn, tenant_id="t1", account_id="acct_1",
                                    notification_type="account.status_changed", payload={"status": "active"},
                                    settings=settings) == []


def test_an_enqueue_on_an_autocommit_connection_is_stored(engine, settings):
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        record = _task(conn, settings)
    with engine.connect() as conn:
        assert conn.execute(select(messages.c.id)).scalars().all() == [record.id]


def test_an_engine_is_not_a_transaction_to_enqueue_in(engine, settings):
    with pytest.raises(TypeError, match="Connection or Session"):
        _task(engine, settings)
    with engine.connect() as conn:
        assert _count(conn) == 0


def test_string_keys_of_any_text_pass_and_render_as_usual(engine, settings):
    result = {"\u00fc": {"k": [1, 2.5, True, None]}, "": "empty key"}
    with engine.begin() as conn:
        record = _task(conn, settings, result=result)
    assert json.loads(stored.body(engine, record.id, settings))["result"] == result


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=5)
_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), _TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(_TEXT, st.integers(), st.booleans(), st.none(), st.floats()),
                                            inner, max_size=4)),
    max_leaves=20)


@given(_VALUES)
def test_json_problem_accepts_exactly_what_json_reads_back_as_given(value):
    """The oracle is ``json`` itself: a value passes when its rendering parses back to it
    (no key turned into a string, no NaN), and fails otherwise."""
    try:
        round_trips = json.loads(json.dumps(value, allow_nan=False)) == value
    except ValueError:
        round_trips = False
    assert (json_problem(value) is None) == round_trips, value


@pytest.mark.parametrize(("text", "sendable"), [
    ('"\\ud800"', False), ('"x\\udfff"', False), ('"\\ud83d\\ude00"', True), ('"\\u00e9"', True), ('"plain"', True),
])
def test_the_daemon_judges_a_plain_sql_body_as_the_producer_does(text: str, sendable: bool) -> None:
    """A row written with plain SQL is checked when claimed: a body escaping a lone surrogate,
    which the producer refuses and strict verifiers (the adcp SDK's) reject, ends dead invalid
    instead of being sent."""
    import hashlib

    from outbox.config import Settings
    from outbox.leases import Claimed
    from outbox.producer import exact_body
    from supervisor.cycle.attempt import integrity_problem

    key = "whk_plain_sql_surrogate_0001"
    body = f'{{"idempotency_key":"{key}","note":{text}}}'.encode()
    row = Claimed(id=1, tenant_id="t", url="https://buyer.example.com/hook", origin=None, idempotency_key=key,
                  body=body, body_sha256=hashlib.sha256(body).digest(), auth_mode="rfc9421", auth_secret=None,
                  sequence_number=None, notification_type=None, attempt=1, retry_until=2e9, created_at=1e9,
                  trigger="scheduled", claimed_at=1.7e9, lease_token="x")
    problem, _ = integrity_problem(row, Settings())
    if sendable:
        assert problem is None and exact_body(body, "payload")[1] == key
    else:
        assert problem is not None and "unpaired surrogate" in problem
        with pytest.raises(outbox.OutboxValidationError, match="unpaired surrogate"):
            exact_body(body, "payload")
