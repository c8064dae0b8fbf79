"""Per-tenant identity, binding, and tenant-scoped gapless streams.

Every test runs against real PostgreSQL and a real SQLite file (the ``engine`` fixture).
"""

from __future__ import annotations

import json
import re
import threading

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st
from sqlalchemy import func, inspect, select, text

import outbox
from outbox.sealing import plaintext
from outbox.db import make_async_engine, make_engine
from outbox.identity import is_stream_key, stream_key
from outbox.migrate import alembic_config, current_revision, upgrade
from outbox.schema import messages, sequences
from supervisor.sdk import OutboxWebhookSupervisor

PNC = {"url": "https://buyer.example.com/hooks?channel=1", "operation_id": "op_123", "token": "tok_abcdefghijklmnop"}
REPORTING = {"url": "https://buyer.example.com/reports?sig=SECRET", "operation_id": "op_rep",
             "token": "reporttoken123456"}
DELIVERY = {"notification_type": "scheduled", "reporting_period": {"start": "2026-11-01T00:00:00Z",
            "end": "2026-11-02T00:00:00Z"}, "currency": "USD", "media_buy_deliveries": []}
KEY = "whk_shared_key_string_0001"


def _task(conn, settings, **overrides):
    kwargs = dict(tenant_id="t1", push_notification_config=PNC, task_id="task_1", task_type="create_media_buy",
                  status="completed", result={"media_buy_id": "mb_1"}, idempotency_key=KEY, settings=settings)
    kwargs.update(overrides)
    return outbox.enqueue_task_webhook(conn, **kwargs)


def _report(conn, settings, **overrides):
    kwargs = dict(tenant_id="t1", reporting_webhook=REPORTING, media_buy_id="mb_1", result=DELIVERY,
                  settings=settings)
    kwargs.update(overrides)
    return outbox.enqueue_delivery_report(conn, **kwargs)


def _rows(engine):
    with engine.connect() as conn:
        return conn.execute(select(messages).order_by(messages.c.id)).all()


def _last_value(engine, key: str) -> int | None:
    with engine.connect() as conn:
        return conn.execute(select(sequences.c.last_value).where(sequences.c.stream_key == key)).scalar()


def test_two_tenants_with_one_key_string_each_get_their_own_message(engine, settings):
    with engine.begin() as conn:
        first = _task(conn, settings, tenant_id="t1", result={"for": "t1"})
        second = _task(conn, settings, tenant_id="t2", result={"for": "t2"})
        again = outbox.enqueue(conn, tenant_id="t3", url=PNC["url"], payload={"idempotency_key": KEY, "e": 1},
                               settings=settings)
        report = _report(conn, settings, tenant_id="t4", idempotency_key=KEY)
    assert len({first.id, second.id, again.id, report.id}) == 4
    rows = _rows(engine)
    assert [(r.tenant_id, r.idempotency_key) for r in rows] == [("t1", KEY), ("t2", KEY), ("t3", KEY), ("t4", KEY)]
    assert json.loads(plaintext(rows[1], settings.sealing()))["result"] == {"for": "t2"}  # not the first tenant's


def test_identical_arguments_retry_returns_the_existing_record(engine, settings):
    """A retry after an ambiguous commit renders a fresh timestamp; it must not conflict."""
    with engine.begin() as conn:
        first = _task(conn, settings)
    with engine.begin() as conn:
        assert _task(conn, settings) == first
        with pytest.raises(outbox.IdempotencyConflictError, match="idempotency_key"):
            _task(conn, settings, result={"media_buy_id": "mb_2"})
        with pytest.raises(outbox.IdempotencyConflictError):
            _task(conn, settings, push_notification_config={**PNC, "url": "https://other.example.com/h"})
    rows = _rows(engine)
    assert len(rows) == 1 and rows[0].binding_digest is not None
    with engine.begin() as conn:  # a row an older release wrote: judged from its stored body alike
        conn.execute(messages.update().values(binding_digest=None))
        assert _task(conn, settings) == first
        with pytest.raises(outbox.IdempotencyConflictError):
            _task(conn, settings, status="failed")


def test_a_changed_delivery_report_under_its_key_raises_and_consumes_no_number(engine, report_settings):
    with engine.begin() as conn:
        first = _report(conn, report_settings, idempotency_key=KEY)
    with engine.begin() as conn:
        # the same report: the same record, the same number
        assert _report(conn, report_settings, idempotency_key=KEY) == first
    corrected = {**DELIVERY, "currency": "EUR"}
    with pytest.raises(outbox.IdempotencyConflictError), engine.begin() as conn:
        _report(conn, report_settings, idempotency_key=KEY, result=corrected)
    with engine.begin() as conn:
        nxt = _report(conn, report_settings, result=corrected)
    assert (first.sequence_number, nxt.sequence_number) == (1, 2)
    assert _last_value(engine, stream_key("t1", "mb_1", REPORTING["url"])) == 2


def test_two_tenants_with_one_stream_key_get_independent_sequences(engine, report_settings):
    numbers: dict[str, list[int]] = {"t1": [], "t2": []}
    for _ in range(3):
        for tenant in numbers:
            with engine.begin() as conn:
                record = _report(conn, report_settings, tenant_id=tenant, stream_key="campaign-42")
            numbers[tenant].append(record.sequence_number)
    assert numbers == {"t1": [1, 2, 3], "t2": [1, 2, 3]}
    assert {r.sequence_key for r in _rows(engine)} == {stream_key("t1", "campaign-42"), stream_key("t2", "campaign-42")}


def test_default_stream_keys_cannot_collide_across_colons(engine, report_settings):
    """("a:b", "c") and ("a", "b:c") joined with ':' were one stream; now they are two."""
    with engine.begin() as conn:
        one = _report(conn, report_settings, tenant_id="a:b", media_buy_id="c")
        two = _report(conn, report_settings, tenant_id="a", media_buy_id="b:c")
        explicit = _report(conn, report_settings, tenant_id="a", stream_key=f"b:c:{REPORTING['url']}")
    assert (one.sequence_number, two.sequence_number, explicit.sequence_number) == (1, 1, 1)


async def test_sdk_sequence_key_is_scoped_by_tenant(engine, settings):
    async_engine = make_async_engine(engine.url.render_as_string(hide_password=False))
    try:
        for tenant in ("t1", "t2", "t1"):
            sdk = OutboxWebhookSupervisor(async_engine, tenant_id=tenant, settings=settings)
            await sdk.send_mcp(url=REPORTING["url"], task_id="mb_1", status="completed",
                               task_type="media_buy_delivery", result=DELIVERY, operation_id="op_rep",
                               sequence_key=f"mb_1:{REPORTING['url']}")
    finally:
        await async_engine.dispose()
    assert [(r.tenant_id, r.sequence_number) for r in _rows(engine)] == [("t1", 1), ("t2", 1), ("t1", 2)]


def test_a_stream_continues_from_its_pre_upgrade_counter(engine, report_settings):
    """A buyer mid-campaign must not see its numbers restart at 1 after the migration."""
    with engine.begin() as conn:
        conn.execute(sequences.insert(), [{"stream_key": f"t1:mb_1:{REPORTING['url']}", "last_value": 41},
                                          {"stream_key": "legacy-stream", "last_value": 7}])
    with engine.begin() as conn:
        assert _report(conn, report_settings).sequence_number == 42
        assert _report(conn, report_settings).sequence_number == 43
        assert _report(conn, report_settings, stream_key="legacy-stream").sequence_number == 8


@pytest.mark.parametrize("written", ["scoped", "pre-0002"])
def test_a_stream_to_a_url_whose_query_spelling_changed_continues_its_numbers(engine, report_settings, written):
    """Releases up to 0.2.0 kept the query's escapes as given (``%7e``, ``'``); the query is now
    normalized (``~``, ``%27``), and with it the default stream's key. The stream continues
    from the counter it reached under the earlier spelling: no number is repeated."""
    given = "https://buyer.example.com/reports?sig=%7e&who=o'brien&x=%2f"
    earlier = given  # what those releases stored: the escapes byte for byte, ' unescaped
    key = stream_key("t1", "mb_1", earlier) if written == "scoped" else f"t1:mb_1:{earlier}"
    with engine.begin() as conn:
        conn.execute(sequences.insert(), [{"stream_key": key, "last_value": 3}])
    with engine.begin() as conn:
        numbers = [_report(conn, report_settings, reporting_webhook={**REPORTING, "url": given}).sequence_number
                   for _ in range(2)]
    assert numbers == [4, 5]
    with engine.begin() as conn:  # another spelling of the same URL, as the producer now writes it
        same = {**REPORTING, "url": "https://buyer.example.com/reports?sig=~&who=o%27brien&x=%2F"}
        assert _report(conn, report_settings, reporting_webhook=same).sequence_number == 6


def test_a_row_without_a_digest_is_judged_by_its_stored_content(engine, settings):
    """Plain-SQL producers and older releases leave binding_digest NULL: compare what is stored."""
    url = "https://buyer.example.com/hooks?channel=1"
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO outbox_messages (tenant_id, url, origin, idempotency_key, body)"
                          " VALUES ('t1', :u, 'https://buyer.example.com', :k, :b)"),
                     {"u": url, "k": KEY, "b": json.dumps({"event": "x", "idempotency_key": KEY}).encode()})
    with engine.begin() as conn:
        found = outbox.enqueue(conn, tenant_id="t1", url=url, payload={"idempotency_key": KEY, "event": "x"},
                               settings=settings)
        with pytest.raises(outbox.IdempotencyConflictError):
            outbox.enqueue(conn, tenant_id="t1", url=url, payload={"idempotency_key": KEY, "event": "y"},
                           settings=settings)
    assert found.id == _rows(engine)[0].id and len(_rows(engine)) == 1


def test_a_concurrent_twin_gives_its_number_back(pg_engine, report_settings):
    """Two transactions with one key: the loser allocated after the winner committed, gives the
    number back, and returns the winner's record (PostgreSQL: real concurrency)."""
    started, results = threading.Event(), {}

    def loser() -> None:
        started.wait()
        with pg_engine.begin() as conn:
            # waits on the stream's row lock
            results["loser"] = _report(conn, report_settings, idempotency_key=KEY)

    thread = threading.Thread(target=loser)
    thread.start()
    with pg_engine.begin() as conn:
        results["winner"] = _report(conn, report_settings, idempotency_key=KEY)
        started.set()
        conn.execute(text("SELECT pg_sleep(0.5)"))
    thread.join(10)
    assert results["loser"] == results["winner"] and results["winner"].sequence_number == 1
    with pg_engine.begin() as conn:
        assert _report(conn, report_settings).sequence_number == 2


def test_migration_converts_an_existing_database(sqlite_url, pg_server_url, tmp_path, settings):
    """0001 data stays readable, the old writer's plain INSERT still works, keys become per tenant."""
    import psycopg
    from sqlalchemy.engine import make_url

    name = f"outboxd_mig_{tmp_path.name[-8:]}".replace("-", "_").lower()
    with psycopg.connect(pg_server_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    pg = make_url(pg_server_url).set(database=name).render_as_string(hide_password=False)
    try:
        for url in (f"sqlite:///{tmp_path / 'old.db'}", pg):
            engine = make_engine(url)
            upgrade(engine, "0001")
            body = json.dumps({"idempotency_key": KEY, "event": "x"}).encode()
            insert = text("INSERT INTO outbox_messages (tenant_id, url, origin, idempotency_key, body)"
                          " VALUES (:t, :u, 'https://buyer.example.com', :k, :b)")
            with engine.begin() as conn:
                conn.execute(insert, {"t": "t1", "u": PNC["url"], "k": KEY, "b": body})
            early = make_engine(url)  # this release's producer, deployed before the migration runs
            ids = set()
            for _ in range(2):  # and the identical retry finds its row, judged by content
                with early.begin() as conn:
                    ids.add(outbox.enqueue(conn, tenant_id="t0", url=PNC["url"], settings=settings,
                                           payload={"idempotency_key": "whk_before_the_migration", "e": 1}).id)
            early.dispose()
            upgrade(engine)
            parent = ScriptDirectory.from_config(alembic_config()).get_revision("0002_tenant_identity").down_revision
            with engine.begin() as conn:  # and back, and forth again: the downgrade restores 0001
                command.downgrade(alembic_config(conn), parent)
                assert current_revision(conn) == parent
            upgrade(engine)
            names = {ix["name"]: ix for ix in inspect(engine).get_indexes("outbox_messages")}
            assert (names["outbox_messages_key_tenant_key"]["unique"]
                    and "outbox_messages_idempotency_key_key" not in names)
            with engine.begin() as conn:
                conn.execute(insert, {"t": "t2", "u": PNC["url"], "k": KEY, "b": body})  # a 0001-style writer
                same = outbox.enqueue(conn, tenant_id="t1", url=PNC["url"],
                                      payload={"idempotency_key": KEY, "event": "x"}, settings=settings)
                third = outbox.enqueue(conn, tenant_id="t3", url=PNC["url"],
                                       payload={"idempotency_key": KEY, "event": "x"}, settings=settings)
                count = conn.execute(select(func.count()).select_from(messages)).scalar_one()
            assert same.id == 1 and third.id > 3 and count == 4 and len(ids) == 1  # (PostgreSQL burns ids)
            engine.dispose()
    finally:
        with psycopg.connect(pg_server_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


_PART = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=12)


@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tenant=_PART, stream=_PART)
def test_plain_sql_sequence_function_uses_the_python_stream_key(pg_engine, tenant, stream):
    """Differential: outbox_next_sequence(tenant, stream) allocates on stream_key(tenant, stream)."""
    with pg_engine.begin() as conn:
        conn.execute(sequences.delete())
        number = conn.execute(text("SELECT outbox_next_sequence(:t, :s)"), {"t": tenant, "s": stream}).scalar_one()
        stored = conn.execute(select(sequences.c.stream_key)).scalars().all()
    assert number == 1 and stored == [stream_key(tenant, stream)]


def test_a_stream_key_spelled_like_another_tenants_never_continues_its_numbers(engine, report_settings):
    """Only a key from before streams were scoped seeds a new stream: a stream_key that is
    itself a scoped key (another tenant's) starts at 1, and shows nothing of that tenant."""
    with engine.begin() as conn:
        assert [_report(conn, report_settings, tenant_id="A", stream_key="s").sequence_number
                for _ in range(5)] == [1, 2, 3, 4, 5]
    with engine.begin() as conn:
        assert _report(conn, report_settings, tenant_id="B", stream_key=stream_key("A", "s")).sequence_number == 1


@given(st.lists(st.text(max_size=8), min_size=1, max_size=4), st.text(max_size=12))
def test_only_whole_stream_key_encodings_are_recognised(parts, other):
    assert is_stream_key(stream_key(*parts))
    assert is_stream_key(other) == (other != "" and _parses(other))


def _parses(text: str) -> bool:
    """A slower, obviously right reading of the encoding: a length, a colon, that many characters."""
    match = re.match(r"([0-9]+):", text)
    if match is None or not match.group(1).isascii():
        return False
    rest = text[match.end():]
    n = int(match.group(1))
    return len(rest) >= n and (len(rest) == n or _parses(rest[n:]))
