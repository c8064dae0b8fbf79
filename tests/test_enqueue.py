"""The producer API against real PostgreSQL and real SQLite files."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as settings_profile
from hypothesis import strategies as st
from sqlalchemy import event, func, select, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import outbox
from outbox import aio, protocol
from outbox.db import make_async_engine
from outbox.identity import stream_key
from outbox.schema import messages, sequences
from tests import stored
from tests.adcp_schema import assert_valid, version_envelope
from tests.ledger import THROWAWAY_KEY

PNC = {"url": "https://buyer.example.com/hooks/adcp?channel=1", "operation_id": "op_123",
       "token": "tok_abcdefghijklmnop"}
REPORTING = {"url": "https://buyer.example.com/reports", "operation_id": "op_rep", "token": "reporttoken123456"}
DELIVERY = {"notification_type": "scheduled", "reporting_period": {"start": "2026-11-01T00:00:00Z",
            "end": "2026-11-02T00:00:00Z"}, "currency": "USD", "media_buy_deliveries": []}


def _count(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(messages)).scalar_one()


def _task(conn, settings, **overrides):
    kwargs = dict(tenant_id="t1", push_notification_config=PNC, task_id="task_1", task_type="create_media_buy",
                  status="completed", result={"media_buy_id": "mb_1"}, context={"trace": "abc"}, settings=settings)
    kwargs.update(overrides)
    return outbox.enqueue_task_webhook(conn, **kwargs)


def test_task_webhook_renders_the_adcp_envelope_once(engine, settings):
    with Session(engine) as session, session.begin():
        record = _task(session, settings)
    row = stored.row(engine, record.id)
    raw = stored.body(engine, record.id, settings)
    body = json.loads(raw)
    assert body["idempotency_key"] == record.idempotency_key == row.idempotency_key
    assert record.idempotency_key.startswith("whk_") and len(record.idempotency_key) == 40
    assert body["notification_id"] == "task_1.terminal"
    assert body["operation_id"] == "op_123" and body["token"] == PNC["token"]
    assert body["context"] == {"trace": "abc"} and body["result"] == {"media_buy_id": "mb_1"}
    assert row.body_sha256 == hashlib.sha256(row.body).digest()
    assert row.state == "pending" and row.auth_mode == "rfc9421" and row.origin == "https://buyer.example.com"
    assert_valid(raw)


@pytest.mark.parametrize("operation_id", [None, "op_30"])
def test_an_adcp_3_0_registration_may_lack_operation_id_and_its_webhook_then_has_none(engine, settings,
                                                                                       operation_id):
    registration = {k: v for k, v in PNC.items() if k != "operation_id"}
    if operation_id is not None:
        registration["operation_id"] = operation_id
    with engine.begin() as conn:
        record = _task(conn, settings, push_notification_config=registration, adcp_version="3.0")
    raw = stored.body(engine, record.id, settings)
    assert (json.loads(raw).get("operation_id") == operation_id
            and stored.row(engine, record.id).operation_id == operation_id)
    assert_valid(raw, release="3.0")  # the payload schema the buyer's release defines


@settings_profile(max_examples=300)
@given(st.one_of(st.from_regex(r"3\.[0-9](-[a-z0-9.]{1,6})?", fullmatch=True), st.text(max_size=12)))
def test_only_a_release_pinned_to_adcp_3_0_may_omit_operation_id(version):
    """Against the version envelope's own pattern: AdCP 3.0, release precision, pre-release or not."""
    envelope = re.compile(version_envelope()["properties"]["adcp_version"]["pattern"])
    is_3_0 = envelope.search(version) is not None and version.split("-", 1)[0] == "3.0" and "\n" not in version
    assert protocol.requires_operation_id(version) is not is_3_0
    assert protocol.requires_operation_id(None) is True


def test_non_terminal_status_has_no_notification_id(engine, settings):
    with Session(engine) as session, session.begin():
        record = _task(session, settings, status="working", result=None)
    body = json.loads(stored.body(engine, record.id, settings))
    assert "notification_id" not in body and "result" not in body
    assert_valid(json.dumps(body).encode())


def test_rollback_leaves_no_message_and_no_sequence_number(engine, report_settings):
    with Session(engine) as session:
        with session.begin():
            _task(session, report_settings)
            report = outbox.enqueue_delivery_report(session, tenant_id="t1", reporting_webhook=REPORTING,
                                                    media_buy_id="mb_1", result=DELIVERY, settings=report_settings)
            assert report.sequence_number == 1
            session.rollback()
    assert _count(engine) == 0
    with Session(engine) as session, session.begin():
        again = outbox.enqueue_delivery_report(session, tenant_id="t1", reporting_webhook=REPORTING,
                                               media_buy_id="mb_1", result=DELIVERY, settings=report_settings)
    assert again.sequence_number == 1


def test_delivery_report_numbers_and_body(engine, report_settings):
    numbers = []
    for _ in range(3):
        with engine.begin() as conn:
            numbers.append(outbox.enqueue_delivery_report(conn, tenant_id="t1", reporting_webhook=REPORTING,
                                                          media_buy_id="mb_9", result=DELIVERY,
                                                          settings=report_settings))
    assert [r.sequence_number for r in numbers] == [1, 2, 3]
    body = json.loads(stored.body(engine, numbers[-1].id, report_settings))
    assert body["result"]["sequence_number"] == 3 and body["task_type"] == "media_buy_delivery"
    assert "notification_id" not in body
    assert_valid(json.dumps(body).encode())
    # Another stream (another media buy) starts at 1 again.
    with engine.begin() as conn:
        other = outbox.enqueue_delivery_report(conn, tenant_id="t1", reporting_webhook=REPORTING,
                                               media_buy_id="mb_10", result=DELIVERY, settings=report_settings)
    assert other.sequence_number == 1


def test_sequence_numbers_gapless_under_concurrency_in_commit_order(pg_engine, report_settings):
    """8 threads x 200 committed transactions on one stream: exactly 1..1600, commit-ordered.

    Commit order is checked inside each transaction: when number n is allocated, numbers
    1..n-1 must all be committed already (visible to this transaction's next statement).
    """
    errors: list[str] = []
    allocated: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(200):
            with pg_engine.begin() as conn:
                record = outbox.enqueue_delivery_report(conn, tenant_id="t1", reporting_webhook=REPORTING,
                                                        media_buy_id="mb_hot", result=DELIVERY,
                                                        settings=report_settings)
                committed_before = conn.execute(text(
                    "SELECT count(*) FROM outbox_messages WHERE sequence_key = :k AND id <> :id"),
                    {"k": stream_key("t1", "mb_hot", REPORTING["url"]), "id": record.id}).scalar_one()
                if committed_before != record.sequence_number - 1:
                    errors.append(f"{record.sequence_number} allocated with {committed_before} committed")
            with lock:
                allocated.append(record.sequence_number)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    assert sorted(allocated) == list(range(1, 1601))
    with pg_engine.connect() as conn:
        stored = conn.execute(select(messages.c.sequence_number).order_by(messages.c.sequence_number)).scalars().all()
        assert stored == list(range(1, 1601))
        assert conn.execute(select(sequences.c.last_value)).scalar_one() == 1600


def test_same_key_same_bytes_returns_existing_different_bytes_raises(engine, settings):
    payload = {"idempotency_key": "whk_fixed_key_0000000001", "notification_type": "creative.status_changed"}
    with engine.begin() as conn:
        first = outbox.enqueue(conn, tenant_id="t1", url=PNC["url"], payload=payload, settings=settings)
    with engine.begin() as conn:
        second = outbox.enqueue(conn, tenant_id="t1", url=PNC["url"], payload=payload, settings=settings)
    assert second == first
    with pytest.raises(outbox.IdempotencyConflictError, match="idempotency_key"), engine.begin() as conn:
        outbox.enqueue(conn, tenant_id="t1", url=PNC["url"], payload={**payload, "x": 1}, settings=settings)
    assert _count(engine) == 1


def test_replayed_report_key_consumes_no_number(engine, report_settings):
    kwargs = dict(tenant_id="t1", reporting_webhook=REPORTING, media_buy_id="mb_1", result=DELIVERY,
                  idempotency_key="whk_report_key_00000001", settings=report_settings)
    with engine.begin() as conn:
        first = outbox.enqueue_delivery_report(conn, **kwargs)
    with engine.begin() as conn:
        assert outbox.enqueue_delivery_report(conn, **kwargs) == first
    with engine.begin() as conn:
        nxt = outbox.enqueue_delivery_report(conn, **{**kwargs, "idempotency_key": None})
    assert nxt.sequence_number == 2


def test_a_report_body_ends_with_its_number_whatever_the_result_carries(engine, report_settings):
    """The seller's own ``sequence_number`` is replaced, the number is the body's last field,
    and the stored digest covers the bytes stored."""
    result = {"sequence_number": 99, **DELIVERY, "note": "é \u2028 \"sequence_number\":1}}"}
    with engine.begin() as conn:
        for _ in range(2):
            record = outbox.enqueue_delivery_report(conn, tenant_id="t1", reporting_webhook=REPORTING,
                                                    media_buy_id="mb_1", result=result, settings=report_settings)
    raw = stored.body(engine, record.id, report_settings)
    body = json.loads(raw)
    assert record.sequence_number == 2 and body["result"] == {**result, "sequence_number": 2}
    assert list(body["result"])[-1] == "sequence_number" and raw.endswith(b'"sequence_number":2}}')
    row = stored.row(engine, record.id)
    assert row.sequence_number == 2 and row.body_sha256 == hashlib.sha256(row.body).digest()


def _statements(engine, call) -> list[str]:
    """The SQL statements ``call(conn)`` sends, in one committed transaction."""
    sent: list[str] = []
    with engine.begin() as conn:
        listen = lambda *args: sent.append(args[2])  # noqa: E731 (conn, cursor, statement, ...)
        event.listen(conn, "before_cursor_execute", listen)
        try:
            call(conn)
        finally:
            event.remove(conn, "before_cursor_execute", listen)
    return sent


def test_a_plaintext_report_costs_one_statement_on_postgresql(pg_engine, settings):
    """The replay check, the stream's number and the row: one round trip (a replay reads its twin too)."""
    plain = replace(settings, encryption_key=None)
    report = dict(tenant_id="t1", reporting_webhook=REPORTING, media_buy_id="mb_1", result=DELIVERY,
                  idempotency_key="whk_report_key_00000001", settings=plain)
    with pg_engine.begin() as conn:  # the engine's first enqueue reads which columns the schema has
        _task(conn, plain)
    assert len(_statements(pg_engine, lambda conn: outbox.enqueue_delivery_report(conn, **report))) == 1
    assert len(_statements(pg_engine, lambda conn: outbox.enqueue_delivery_report(conn, **report))) == 2
    minted = {**report, "idempotency_key": None}
    assert len(_statements(pg_engine, lambda conn: outbox.enqueue_delivery_report(conn, **minted))) == 1
    with pg_engine.connect() as conn:
        assert conn.execute(select(sequences.c.last_value)).scalar_one() == 2


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                 max_size=3),
                     max_leaves=8)


@settings_profile(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.text(max_size=12).filter(lambda k: k != "notification_type"), _JSON, max_size=5))
def test_any_report_result_is_stored_with_its_number_in_place(pg_engine, settings, result):
    """Differential: the body spliced around the number decodes to the result the seller gave, numbered."""
    plain = replace(settings, encryption_key=None)
    with pg_engine.begin() as conn:
        record = outbox.enqueue_delivery_report(conn, tenant_id="t1", reporting_webhook=REPORTING,
                                                media_buy_id="mb_any", result=result, settings=plain)
    body = json.loads(stored.body(pg_engine, record.id, plain))
    assert body["result"] == {**{k: v for k, v in result.items() if k != "sequence_number"},
                              "sequence_number": record.sequence_number}


BAD_INPUTS = [
    ("push_notification_config.url", dict(push_notification_config={**PNC, "url": "ftp://x.example/h"})),
    ("url", dict(push_notification_config={**PNC, "url": "/relative/path"})),
    ("url", dict(push_notification_config={**PNC, "url": "https://user:pw@buyer.example.com/h"})),
    ("url", dict(push_notification_config={**PNC, "url": "https://buyer.example.com/h#frag"})),
    ("url", dict(push_notification_config={**PNC, "url": "https://10.1.2.3/h"})),
    ("url", dict(push_notification_config={**PNC, "url": "https://[::ffff:192.168.0.1]/h"})),
    ("url", dict(push_notification_config={**PNC, "url": "https://169.254.169.254/latest"})),
    ("operation_id", dict(push_notification_config={k: v for k, v in PNC.items() if k != "operation_id"})),
    ("operation_id", dict(push_notification_config={**PNC, "operation_id": "op with spaces"})),
    ("operation_id", dict(push_notification_config={k: v for k, v in PNC.items() if k != "operation_id"},
                          adcp_version="3.1")),
    ("adcp_version", dict(adcp_version=3)),
    ("task_type", dict(task_type="make_coffee")),
    ("status", dict(status="done")),
    ("result", dict(result={"blob": "x" * (1024 * 1024)})),
    ("result", dict(result={"when": object()})),
    ("result", dict(result={"ratio": float("nan")})),
    ("idempotency_key", dict(idempotency_key="short")),
    ("idempotency_key", dict(idempotency_key="has spaces in the key!!")),
    ("token", dict(push_notification_config={**PNC, "token": "tooshort"})),
    ("token", dict(push_notification_config={**PNC, "token": "x" * 4097})),
    ("credentials", dict(push_notification_config={**PNC, "authentication": {"schemes": ["HMAC-SHA256"],
                                                                           "credentials": "short-secret"}})),
    ("credentials", dict(push_notification_config={**PNC, "authentication": {"schemes": ["Bearer"],
                                                                           "credentials": "x" * 4097}})),
    ("schemes", dict(push_notification_config={**PNC, "authentication": {"schemes": ["Basic"],
                                                                       "credentials": "x" * 40}})),
    ("tenant_id", dict(tenant_id="")),
    ("context", dict(context=["not", "an", "object"])),
]


@pytest.mark.parametrize(("field", "overrides"), BAD_INPUTS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_INPUTS)])
def test_bad_input_raises_the_documented_error_and_writes_nothing(engine, settings, field, overrides):
    strict = outbox.load_settings(env={"OUTBOX_ENCRYPTION_KEY": THROWAWAY_KEY})
    with Session(engine) as session, session.begin():
        with pytest.raises(outbox.OutboxValidationError) as caught:
            _task(session, strict, **overrides)
        assert isinstance(caught.value, ValueError)
        assert field.split(".")[-1] in caught.value.field or field in str(caught.value)
    assert _count(engine) == 0


def test_http_and_private_ips_need_the_operator_switches(engine, settings):
    strict = outbox.load_settings(env={})
    config = {**PNC, "url": "http://127.0.0.1:8080/hook"}
    with engine.begin() as conn:
        with pytest.raises(outbox.OutboxValidationError, match="https"):
            _task(conn, strict, push_notification_config=config)
        with pytest.raises(outbox.OutboxValidationError, match="loopback"):
            _task(conn, outbox.load_settings(env={"OUTBOX_ALLOW_HTTP": "true"}), push_notification_config=config)
        assert _task(conn, settings, push_notification_config=config).id > 0


def test_legacy_credentials_are_encrypted_and_need_a_key(engine, settings):
    secret = "hmac-secret-value-0123456789-abcdefgh"
    config = {**PNC, "authentication": {"schemes": ["HMAC-SHA256"], "credentials": secret}}
    with engine.begin() as conn:
        with pytest.raises(outbox.OutboxValidationError, match="OUTBOX_ENCRYPTION_KEY"):
            _task(conn, outbox.load_settings(env={}), push_notification_config=config)
        record = _task(conn, settings, push_notification_config=config)
    with engine.connect() as conn:
        row = conn.execute(select(messages).where(messages.c.id == record.id)).one()
    assert row.auth_mode == "hmac"
    assert secret.encode() not in bytes(row.auth_secret) and secret.encode() not in bytes(row.body)
    from outbox.sealing import CREDENTIAL

    assert settings.sealing().open(CREDENTIAL, bytes(row.auth_secret), tenant_id="t1",
                                   idempotency_key=record.idempotency_key) == secret.encode()


def test_enqueue_raw_bytes_kept_exactly(engine, settings):
    raw = b'{"idempotency_key": "whk_raw_bytes_000000001",  "event": "capabilities.changed"}'
    with engine.begin() as conn:
        record = outbox.enqueue(conn, tenant_id="t1", url=PNC["url"], payload=raw, settings=settings)
    assert stored.body(engine, record.id, settings) == raw
    for bad in (b"[1,2]", b'{"idempotency_key":"whk_raw_bytes_000000002","a":1,"a":2}', b"\xff"):
        with pytest.raises(outbox.OutboxValidationError), engine.begin() as conn:
            outbox.enqueue(conn, tenant_id="t1", url=PNC["url"], payload=bad, settings=settings)


async def test_async_variants_share_the_callers_transaction(engine, settings):
    url = engine.url.render_as_string(hide_password=False)
    async_engine = make_async_engine(url)
    try:
        async with AsyncSession(async_engine) as session:
            async with session.begin():
                task = await aio.enqueue_task_webhook(session, tenant_id="t1", push_notification_config=PNC,
                                                      task_id="task_a", task_type="create_media_buy",
                                                      status="failed", settings=settings)
                report = await aio.enqueue_delivery_report(session, tenant_id="t1", reporting_webhook=REPORTING,
                                                           media_buy_id="mb_a", result=DELIVERY, settings=settings)
                await session.rollback()
        async with async_engine.begin() as conn:
            again = await aio.enqueue_delivery_report(conn, tenant_id="t1", reporting_webhook=REPORTING,
                                                      media_buy_id="mb_a", result=DELIVERY, settings=settings)
            other = await aio.enqueue(conn, tenant_id="t1", url=PNC["url"], payload={"event": "x"}, settings=settings)
    finally:
        await async_engine.dispose()
    assert task.id and report.sequence_number == 1 and again.sequence_number == 1 and other.id
    assert _count(engine) == 2


def test_pure_sql_enqueue_on_postgresql(pg_engine, pg_url):
    """Any language can enqueue: a plain INSERT, the sequence function, one NOTIFY per txn."""
    import psycopg

    listener = psycopg.connect(pg_url.replace("+psycopg", ""), autocommit=True)
    listener.execute("LISTEN outbox_wakeup")
    body = b'{"idempotency_key":"whk_sql_producer_00000001","task_type":"media_buy_delivery"}'
    with pg_engine.begin() as conn:
        seq = conn.execute(text("SELECT outbox_next_sequence('ts:mb_1:https://b.example/r')")).scalar_one()
        for i in range(3):
            conn.execute(text("INSERT INTO outbox_messages (tenant_id, url, idempotency_key, body, sequence_number)"
                              " VALUES ('ts', 'https://B.example:443/r?x=1', :k, :b, :s)"),
                         {"k": f"whk_sql_producer_0000000{i + 1}", "b": body.replace(b"01", f"0{i + 1}".encode()),
                          "s": seq})
    notes = list(listener.notifies(timeout=1.0, stop_after=5))
    listener.close()
    assert len(notes) == 1 and notes[0].channel == "outbox_wakeup"
    with pg_engine.connect() as conn:
        rows = conn.execute(select(messages).order_by(messages.c.id)).all()
    assert [r.state for r in rows] == ["pending"] * 3
    assert rows[0].origin == "https://b.example" and rows[0].body_sha256 == hashlib.sha256(rows[0].body).digest()
    assert rows[0].created_at > 1.7e9 and rows[0].next_attempt_at == rows[0].created_at and seq == 1


async def test_the_async_api_refuses_an_engine_or_a_driver_connection_as_the_sync_one_does(engine, settings):
    """An AsyncEngine (an easy slip for an async seller) or a driver connection has no
    transaction of the seller's to join: TypeError naming what was passed, not AttributeError."""
    from outbox import aio
    from outbox.db import make_async_engine

    async_engine = make_async_engine(engine.url.render_as_string(hide_password=False))
    try:
        async with async_engine.connect() as conn:
            raw = await conn.get_raw_connection()
            for wrong in (async_engine, engine, raw):
                with pytest.raises(TypeError, match="AsyncConnection or AsyncSession.*not "):
                    await aio.enqueue_task_webhook(wrong, **dict(tenant_id="t1", push_notification_config=PNC,
                                                                task_id="task_1", task_type="create_media_buy",
                                                                status="completed", settings=settings))
    finally:
        await async_engine.dispose()
