"""Fuzzed producer input: every rejection is an ``OutboxValidationError`` and writes nothing.

Each property draws every keyword argument of the public enqueue API either from a valid
range or from junk (wrong types, unhashable values, NaN, control characters, non-JSON
objects, out-of-range numbers), calls the API inside a seller transaction, and then:

* a rejection must be :class:`outbox.OutboxValidationError` (any other exception is a bug),
  and the caller's transaction must be untouched and still usable: the test commits it
  anyway, as a seller that catches the error and goes on would, and no message or
  sequence number may have been written;
* an acceptance must have stored bytes that parse as a strict JSON object carrying the
  returned ``idempotency_key``, matching the row's key and SHA-256, and (task webhooks and
  delivery reports) an envelope valid against the AdCP schema;
* a fully valid call is always accepted (separate properties).

SQLite files carry most examples (fast); a small number run on PostgreSQL, whose stricter
types (no NUL in text, aborted transactions after an error) catch what SQLite lets pass.
Response parsers are fuzzed in ``tests/test_classify.py``.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import datetime
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, note, settings as hsettings, strategies as st
from hypothesis.errors import InvalidArgument
from sqlalchemy import func, select
from sqlalchemy.orm import Session

import outbox
from outbox import protocol
from outbox.producer import decode_body
from outbox.schema import messages, sequences
from tests import stored
from tests.adcp_schema import validator as adcp_validator

FUZZ = hsettings(max_examples=250, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
FUZZ_PG = hsettings(FUZZ, max_examples=40)
VALID = hsettings(FUZZ, max_examples=120)

# ---------------------------------------------------------------------------------------
# Junk and valid values, field by field.
#
# Every field gets the full junk space, including what once escaped validation (unhashable
# values in enum fields, non-numeric horizons, NUL and lone surrogates in stored strings,
# non-string message/context_id/task_id/notification_type, a horizon checked after the
# sequence number was taken): the regression examples at the bottom pin each of those.

_scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
            | st.binary(max_size=12))
_odd = st.sampled_from([object(), {1, 2}, frozenset(), Decimal("1.5"), datetime(2026, 1, 1), float("nan"),
                        float("inf"), b"\xff\xfe", bytearray(b"{}"), (1, 2), 10 ** 400, -1, 0, "", " ",
                        "\x00", "a\nb", "\u202e", [], {}, [{}], {"": None}, {1: 2}, {(1,): 2}])
JUNK = st.recursive(_scalars | _odd, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


BAD_STRING = st.sampled_from(["t\x00", "\ud800", "a\udfffb", "\x00"]) | st.text(min_size=1).map(lambda t: t + "\x00")
JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 53, 2 ** 53)
                       | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                   max_size=4),
                       max_leaves=12)

_ID_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-"
KEY = st.text(_ID_CHARS, min_size=16, max_size=64)
OP_ID = st.text(_ID_CHARS, min_size=1, max_size=40)
HOSTS = st.sampled_from(["buyer.example.com", "BUYER.Example.com.", "127.0.0.1", "xn--bcher-kva.example",
                         "bücher.example", "[2606:4700::1111]", "a.b.c.example"])
URL = st.builds(lambda scheme, host, port, path, query: f"{scheme}://{host}{port}{path}{query}",
                st.sampled_from(["https", "http", "HTTPS"]), HOSTS,
                st.sampled_from(["", ":443", ":8443", ":1"]),
                st.sampled_from(["", "/", "/hooks/adcp", "/a%2fb/c", "/%C3%BC", "/ü", "/~u/%7e/./x"]),
                st.sampled_from(["", "?channel=1", "?a=b&c=%20", "?q=ü&q=+", "?a[]={x}"]))
BAD_URL = st.sampled_from(["ftp://buyer.example.com/", "https://user:pw@buyer.example.com/", "https://10.0.0.1/",
                           "https://169.254.169.254/latest", "https://[::1]/", "https://buyer.example.com/#f",
                           "https://buyer.example.com:99999/", "https://buyer .example.com/", "//buyer.example.com/",
                           "https://", "https://-bad-.example/", "https://buyer.example.com/\x7f", "x" * 3000,
                           "https://0x7f000001/", "https://[::ffff:10.0.0.1]/", "http://[fe80::1%25eth0]/",
                           "https://buyer.example.com/a%zz", "https://buyer.example.com/%2e%2E/x",
                           "https://buyer.example.com/a\\b"])
# Plausible names (valid values); NUL and lone surrogates come with the junk (BAD_STRING).
_COLUMN_CHARS = st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00")
NAME = st.text(_COLUMN_CHARS, min_size=1, max_size=24) | st.text(_ID_CHARS, min_size=1, max_size=24)
SECRET = "s" * 40
AUTH = st.sampled_from([None, {"schemes": ["HMAC-SHA256"], "credentials": SECRET},
                        {"schemes": ["Bearer"], "credentials": SECRET}])
AUTH_JUNK = st.fixed_dictionaries({}, optional={
    "schemes": JUNK | st.lists(JUNK | st.sampled_from(["HMAC-SHA256", "Bearer", "bearer"]),
                                         max_size=2),
    "credentials": JUNK | st.text(max_size=40)})


HORIZON = st.integers(86_400, 604_800) | st.none()
TOKEN = st.text(min_size=16, max_size=40) | st.none()
PAYLOAD = st.dictionaries(st.text(max_size=8), JSONISH, max_size=4)
RAW_PAYLOAD = st.one_of(
    st.builds(lambda key, extra: json.dumps({**extra, "idempotency_key": key}).encode(), KEY, PAYLOAD),
    st.binary(max_size=40),
    st.sampled_from([b"", b"[]", b"null", b'{"idempotency_key": 1}', b'{"a":1,"a":2}', b'{"x": NaN}',
                     b'\xef\xbb\xbf{"idempotency_key":"whk_aaaaaaaaaaaaaaaa"}',
                     b'{"idempotency_key":"whk_aaaaaaaaaaaaaaaa","x":1e999}', b"[" * 5000 + b"]" * 5000,
                     b'{"idempotency_key":"whk_aaaaaaaaaaaaaaaa"} trailing',
                     b'{"idempotency_key":"whk_aaaaaaaaaaaaaaaa","x":"\xff"}']),
)


@dataclass(frozen=True)
class Field:
    valid: st.SearchStrategy[Any]
    junk: st.SearchStrategy[Any] = JUNK
    required: bool = True


def valid_kwargs(fields: dict[str, Field]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({n: f.valid for n, f in fields.items() if f.required},
                                 optional={n: f.valid for n, f in fields.items() if not f.required})


def fuzzed_kwargs(fields: dict[str, Field], *, min_corrupt: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """Valid values except for one or two fields drawn as junk, so every field's checks are reached."""
    names = sorted(fields)

    @st.composite
    def build(draw: Any) -> dict[str, Any]:
        corrupt = draw(st.sets(st.sampled_from(names), min_size=min_corrupt, max_size=2))
        out = {}
        for name in names:
            spec = fields[name]
            if name in corrupt:
                out[name] = draw(spec.junk)
            elif spec.required or draw(st.booleans()):
                out[name] = draw(spec.valid)
        return out

    return build()


REGISTRATION = {
    "url": Field(URL, JUNK | BAD_URL),
    "operation_id": Field(OP_ID),
    "token": Field(TOKEN, required=False),
    "authentication": Field(AUTH, JUNK | AUTH_JUNK, required=False),
    "extra": Field(JUNK, JUNK, required=False),  # unknown keys are ignored
}
REGISTRATION_JUNK = JUNK | fuzzed_kwargs(REGISTRATION, min_corrupt=1)
TASK = {
    "tenant_id": Field(NAME, JUNK | BAD_STRING),
    "push_notification_config": Field(valid_kwargs(REGISTRATION), REGISTRATION_JUNK),
    "task_id": Field(st.text(_ID_CHARS, min_size=1, max_size=200) | NAME, JUNK | BAD_STRING),
    "task_type": Field(st.sampled_from(sorted(protocol.TASK_TYPES)), JUNK),
    "status": Field(st.sampled_from(sorted(protocol.TASK_STATUSES)), JUNK),
    "result": Field(JSONISH, required=False),
    "message": Field(st.text(min_size=1, max_size=30) | st.none(), JUNK | BAD_STRING, required=False),
    "context_id": Field(NAME | st.none(), JUNK | BAD_STRING, required=False),
    "context": Field(st.dictionaries(st.text(max_size=6), JSONISH, max_size=3) | st.none(), required=False),
    "idempotency_key": Field(KEY | st.none(), required=False),
    "notification_id": Field(OP_ID | st.none(), required=False),
    "horizon_seconds": Field(HORIZON, JUNK | st.text(max_size=8), required=False),
}
GENERIC = {
    "tenant_id": Field(NAME, JUNK | BAD_STRING),
    "url": Field(URL, JUNK | BAD_URL),
    "payload": Field(PAYLOAD | RAW_PAYLOAD),  # RAW_PAYLOAD holds junk bytes too
    "idempotency_key": Field(KEY | st.none(), JUNK, required=False),
    "authentication": Field(AUTH, JUNK | AUTH_JUNK, required=False),
    "notification_type": Field(st.sampled_from(sorted(protocol.DELIVERY_NOTIFICATION_TYPES)) | st.none(),
                               JUNK | BAD_STRING, required=False),
    "horizon_seconds": Field(HORIZON, JUNK | st.text(max_size=8), required=False),
}
REPORT_RESULT = {
    "reporting_period": Field(st.just({"start": "2026-01-01T00:00:00Z", "end": "2026-01-02T00:00:00Z"}),
                              required=False),
    "notification_type": Field(st.sampled_from(sorted(protocol.DELIVERY_NOTIFICATION_TYPES)), JUNK,
                               required=False),
    "media_buy_deliveries": Field(st.lists(PAYLOAD, max_size=2), required=False),
}
REPORT = {
    "tenant_id": Field(NAME, JUNK | BAD_STRING),
    "reporting_webhook": Field(valid_kwargs(REGISTRATION), REGISTRATION_JUNK),
    "media_buy_id": Field(NAME, JUNK | BAD_STRING),
    "result": Field(valid_kwargs(REPORT_RESULT), JUNK | fuzzed_kwargs(REPORT_RESULT, min_corrupt=1)),
    "stream_key": Field(NAME | st.none(), JUNK | BAD_STRING, required=False),
    "idempotency_key": Field(KEY | st.none(), required=False),
    "task_id": Field(NAME | st.none(), JUNK | BAD_STRING, required=False),
    "horizon_seconds": Field(HORIZON, JUNK | st.text(max_size=8), required=False),
}

TASK_KWARGS, VALID_TASK_KWARGS = fuzzed_kwargs(TASK), valid_kwargs(
    {**TASK, "idempotency_key": Field(st.none(), required=False),
     "task_id": Field(st.text(_ID_CHARS, min_size=1, max_size=200))})  # terminal ids derive from task_id
GENERIC_KWARGS = fuzzed_kwargs(GENERIC)
REPORT_KWARGS, VALID_REPORT_KWARGS = fuzzed_kwargs(REPORT), valid_kwargs(
    {**REPORT, "idempotency_key": Field(st.none(), required=False)})


class RawBody(dict):
    """A payload the valid-input test sends as raw bytes, with a fresh key added there."""


VALID_GENERIC_KWARGS = valid_kwargs({**GENERIC, "payload": Field(PAYLOAD | st.builds(RawBody, PAYLOAD)),
                                     "idempotency_key": Field(st.none(), required=False)})


# ---------------------------------------------------------------------------------------
# The property, shared by every API and both databases.

def _counts(conn: Any) -> tuple[int, int, int]:
    """Messages, sequence streams, and the sum of all sequence counters."""
    return (conn.execute(select(func.count()).select_from(messages)).scalar_one(),
            conn.execute(select(func.count()).select_from(sequences)).scalar_one(),
            conn.execute(select(func.coalesce(func.sum(sequences.c.last_value), 0))).scalar_one())


def _note(text: str, label: str | None = None) -> None:
    try:
        note(text)
        if label is not None:
            event(label)  # --hypothesis-show-statistics shows how deep examples get
    except InvalidArgument:  # not inside a hypothesis test (the regression examples)
        pass


def _jsonable(value: Any) -> Any:
    """What ``value`` becomes after a JSON round trip (tuples → lists, int keys → strings)."""
    return json.loads(json.dumps(value))


def _caller_key(kwargs: dict[str, Any]) -> Any:
    payload = kwargs.get("payload")
    if kwargs.get("idempotency_key") is not None:
        return kwargs["idempotency_key"]
    if isinstance(payload, (bytes, bytearray)):
        return (decode_body(bytes(payload)) or {}).get("idempotency_key")
    if isinstance(payload, dict):
        return payload.get("idempotency_key")
    return None


def check_enqueue(engine: Any, api: Any, kwargs: dict[str, Any], settings: Any) -> Any:
    """Call ``api`` in a seller transaction and check the property.

    Returns ``None`` for a rejection, else ``(record, decoded body, stored row)``.
    """
    _note(f"kwargs={kwargs!r}")
    with engine.connect() as conn:
        before = _counts(conn)
    record = error = None
    with Session(engine) as session:
        with session.begin():
            try:
                record = api(session, settings=settings, **kwargs)
            except outbox.OutboxValidationError as exc:
                error = exc
            # A seller that caught the error goes on and commits its other work: the
            # transaction must still be usable, and hold nothing of ours.
            after_in_txn = _counts(session.connection())
    with engine.connect() as conn:
        after = _counts(conn)
    if error is not None:
        _note(f"rejected: {error}", f"rejected {error.field}")
        assert isinstance(error.field, str) and error.field and str(error)
        assert after_in_txn == before and after == before, "a rejected enqueue wrote something"
        return None
    assert record is not None
    _note(f"accepted: {record}", "accepted")
    row = stored.row(engine, record.id)
    body = stored.body(engine, record.id, settings)
    decoded = decode_body(body)
    assert decoded is not None, f"stored body is not a strict JSON object: {body[:200]!r}"
    assert json.loads(body) == decoded
    assert decoded["idempotency_key"] == record.idempotency_key == row.idempotency_key
    assert protocol.IDEMPOTENCY_KEY_RE.fullmatch(record.idempotency_key)
    assert row.body_sha256 == hashlib.sha256(row.body).digest()
    assert len(body) <= protocol.MAX_BODY_BYTES
    if after[0] == before[0]:  # only a caller-supplied key already stored returns the existing message
        assert record.idempotency_key == _caller_key(kwargs)
    else:
        assert after[0] == before[0] + 1
    return record, decoded, row


def _assert_adcp_envelope(body: dict[str, Any]) -> None:
    """The stored body is a valid AdCP webhook envelope (``result`` is the caller's business)."""
    errors = [e.message for e in adcp_validator().iter_errors({k: v for k, v in body.items() if k != "result"})]
    assert not errors, f"stored envelope violates the AdCP schema: {errors[:3]}"


def _check_task(engine: Any, kwargs: dict[str, Any], settings: Any) -> Any:
    out = check_enqueue(engine, outbox.enqueue_task_webhook, kwargs, settings)
    if out is None:
        return None
    record, body, row = out
    _assert_adcp_envelope(body)
    assert body["task_id"] == kwargs["task_id"] and body["task_type"] == kwargs["task_type"]
    assert body["status"] == kwargs["status"]
    assert body["operation_id"] == kwargs["push_notification_config"]["operation_id"]
    if kwargs.get("result") is not None:
        assert body["result"] == _jsonable(kwargs["result"])
    if kwargs.get("idempotency_key") is not None:
        assert record.idempotency_key == kwargs["idempotency_key"]
    assert row.tenant_id == kwargs["tenant_id"]
    return out


def _check_generic(engine: Any, kwargs: dict[str, Any], settings: Any) -> Any:
    out = check_enqueue(engine, outbox.enqueue, kwargs, settings)
    if out is None:
        return None
    record, body, row = out
    payload = kwargs["payload"]
    if isinstance(payload, (bytes, bytearray)):
        assert stored.body(engine, record.id, settings) == bytes(payload), "raw bytes must be sent exactly as given"
    else:
        expected = _jsonable(payload)
        expected["idempotency_key"] = record.idempotency_key
        assert body == expected
    if kwargs.get("idempotency_key") is not None:
        assert record.idempotency_key == kwargs["idempotency_key"]
    return out


def _check_report(engine: Any, kwargs: dict[str, Any], settings: Any) -> Any:
    out = check_enqueue(engine, outbox.enqueue_delivery_report, kwargs, settings)
    if out is None:
        return None
    record, body, row = out
    _assert_adcp_envelope(body)
    assert body["task_type"] == protocol.DELIVERY_TASK_TYPE
    assert isinstance(record.sequence_number, int) and record.sequence_number >= 1
    assert body["result"]["sequence_number"] == record.sequence_number == row.sequence_number
    return out


def _fresh_raw(kwargs: dict[str, Any]) -> dict[str, Any]:
    if isinstance(kwargs.get("payload"), RawBody):
        payload = {**kwargs["payload"], "idempotency_key": f"whk_{uuid.uuid4()}"}
        kwargs = {**kwargs, "payload": json.dumps(payload, ensure_ascii=False).encode()}
    return kwargs


# ---------------------------------------------------------------------------------------
# SQLite: many examples.

@FUZZ
@given(kwargs=TASK_KWARGS)
def test_fuzz_enqueue_task_webhook_sqlite(sqlite_engine, settings, kwargs):
    _check_task(sqlite_engine, kwargs, settings)


@FUZZ
@given(kwargs=GENERIC_KWARGS)
def test_fuzz_enqueue_sqlite(sqlite_engine, settings, kwargs):
    _check_generic(sqlite_engine, kwargs, settings)


@FUZZ
@given(kwargs=REPORT_KWARGS)
def test_fuzz_enqueue_delivery_report_sqlite(sqlite_engine, settings, kwargs):
    _check_report(sqlite_engine, kwargs, settings)


@VALID
@given(kwargs=VALID_TASK_KWARGS)
def test_valid_task_webhook_always_accepted_sqlite(sqlite_engine, settings, kwargs):
    assert _check_task(sqlite_engine, kwargs, settings) is not None, "a valid call was rejected"


@VALID
@given(kwargs=VALID_GENERIC_KWARGS)
def test_valid_enqueue_always_accepted_sqlite(sqlite_engine, settings, kwargs):
    assert _check_generic(sqlite_engine, _fresh_raw(kwargs), settings) is not None, "a valid call was rejected"


@VALID
@given(kwargs=VALID_REPORT_KWARGS)
def test_valid_delivery_report_always_accepted_sqlite(sqlite_engine, settings, kwargs):
    assert _check_report(sqlite_engine, kwargs, settings) is not None, "a valid call was rejected"


# ---------------------------------------------------------------------------------------
# PostgreSQL: fewer examples, stricter database.

@FUZZ_PG
@given(kwargs=TASK_KWARGS)
def test_fuzz_enqueue_task_webhook_postgresql(pg_engine, settings, kwargs):
    _check_task(pg_engine, kwargs, settings)


@FUZZ_PG
@given(kwargs=GENERIC_KWARGS)
def test_fuzz_enqueue_postgresql(pg_engine, settings, kwargs):
    _check_generic(pg_engine, kwargs, settings)


@FUZZ_PG
@given(kwargs=REPORT_KWARGS)
def test_fuzz_enqueue_delivery_report_postgresql(pg_engine, report_settings, kwargs):
    _check_report(pg_engine, kwargs, report_settings)


@FUZZ_PG
@given(task=VALID_TASK_KWARGS, generic=VALID_GENERIC_KWARGS, report=VALID_REPORT_KWARGS)
def test_valid_input_always_accepted_postgresql(pg_engine, settings, task, generic, report):
    assert _check_task(pg_engine, task, settings) is not None
    assert _check_generic(pg_engine, _fresh_raw(generic), settings) is not None
    assert _check_report(pg_engine, report, settings) is not None


# ---------------------------------------------------------------------------------------
# Regressions: inputs the fuzzing once found escaping OutboxValidationError (or writing
# something when rejected), each pinned by one example on both databases.

PNC = {"url": "https://buyer.example.com/hook", "operation_id": "op_1"}
_TASK = dict(tenant_id="t1", push_notification_config=PNC, task_id="task_1", task_type="create_media_buy",
             status="completed")
_REPORT = dict(tenant_id="t1", reporting_webhook=PNC, media_buy_id="mb_1", result={})
_GENERIC = dict(tenant_id="t1", url="https://buyer.example.com/hook", payload={"a": 1})
_BASE = {"task": (_TASK, _check_task), "report": (_REPORT, _check_report), "generic": (_GENERIC, _check_generic)}

FOUND = [  # (what it did, api, overrides)
    ("unhashable task_type: TypeError", "task", {"task_type": ["create_media_buy"]}),
    ("unhashable status: TypeError", "task", {"status": {"completed": 1}}),
    ("unhashable authentication.schemes[0]: TypeError", "task",
     {"push_notification_config": {**PNC, "authentication": {"schemes": [["Bearer"]], "credentials": SECRET}}}),
    ("unhashable result.notification_type: TypeError", "report", {"result": {"notification_type": []}}),
    ("horizon_seconds='100000': TypeError", "task", {"horizon_seconds": "100000"}),
    ("horizon_seconds=[]: TypeError", "generic", {"horizon_seconds": []}),
    ("enqueue(notification_type={}) reached the driver", "generic", {"notification_type": {}}),
    ("lone surrogate in tenant_id: UnicodeEncodeError", "task", {"tenant_id": "t\ud800"}),
    ("rejected horizon_seconds consumed a sequence number", "report", {"horizon_seconds": 5}),
    ("report task_id=[1] stored unvalidated", "report", {"task_id": [1]}),
    ("message={...} rendered into the envelope", "task", {"message": {"a": 1}}),
    ("context_id=[1] rendered into the envelope", "task", {"context_id": [1]}),
    ("NUL in tenant_id: DataError on PostgreSQL, transaction aborted", "task", {"tenant_id": "t\x00"}),
    ("NUL in task_id (non-terminal status): DataError", "task", {"task_id": "t\x00", "status": "working"}),
    ("NUL in media_buy_id: DataError", "report", {"media_buy_id": "m\x00"}),
    ("NUL in stream_key: DataError", "report", {"stream_key": "s\x00"}),
]


@pytest.mark.parametrize("what,api,overrides", [pytest.param(*f, id=f"{f[1]}-{i}") for i, f in enumerate(FOUND)])
def test_found_by_fuzzing_is_rejected_cleanly(engine, settings, what, api, overrides):
    base, check = _BASE[api]
    assert check(engine, {**base, **overrides}, settings) is None, f"accepted: {what}"


@pytest.mark.parametrize("junk_key", ["", [], 0, False])
def test_enqueue_rejects_a_falsy_idempotency_key(engine, settings, junk_key):
    assert _check_generic(engine, {**_GENERIC, "idempotency_key": junk_key}, settings) is None, \
        "a junk idempotency_key was replaced by a fresh one instead of being rejected"
