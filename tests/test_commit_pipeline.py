"""An enqueue whose key it minted rides the seller's COMMIT on PostgreSQL (outbox/commit_pipeline.py).

Judged from the server's side: what the seller's backend last ran (``pg_stat_activity``),
what a later statement of the same transaction sees, and what is stored once it ends. The
message must exist if and only if the transaction commits, whatever the seller does between
the enqueue and the end (savepoints, reads, rollbacks, closing the connection unfinished).
"""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import sqlalchemy.exc
from sqlalchemy import event, func, select
from sqlalchemy.orm import Session

import outbox
from outbox import aio
from outbox.db import make_async_engine
from outbox.errors import MessageRolledBack
from outbox.schema import messages
from tests import stored
from tests.seller_transactions import PNC, backend_pid, count_messages, enqueue_task, last_statement, task_after_update


def test_the_insert_goes_with_the_commit_and_the_id_comes_back_with_it(hooked, settings):
    engine = hooked
    with engine.connect() as conn:
        pid, record = task_after_update(conn, settings)
        assert last_statement(engine, pid).startswith("UPDATE seller_tasks")  # nothing sent for the enqueue yet
        assert "with the COMMIT" in repr(record)
        conn.commit()
        assert last_statement(engine, pid) == "COMMIT"
    assert count_messages(engine) == 2
    row = stored.row(engine, record.id)
    assert row.idempotency_key == record.idempotency_key and row.state == "pending" and row.task_id == "task_1"
    assert record == outbox.EnqueuedMessage(row.id, row.idempotency_key) and repr(record).startswith(
        f"EnqueuedMessage(id={row.id},")
    assert pickle.loads(pickle.dumps(record)) == record
    with pytest.raises(AttributeError, match="immutable"):
        record.idempotency_key = "whk_other"


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "plaintext"])
def test_an_enqueue_first_on_a_connection_is_committed_with_it(hooked, settings, sealed):
    """Nothing else ran on the connection (and without a sealing key the enqueue reads nothing):
    the enqueue itself begins the transaction the commit ends."""
    engine, settings = hooked, settings if sealed else replace(settings, encryption_key=None)
    with engine.connect() as conn:
        record = enqueue_task(conn, settings)
        conn.commit()
    assert stored.row(engine, record.id).task_id == "task_1"


def test_a_later_statement_of_the_transaction_sees_the_row(seller_table, settings):
    engine = seller_table
    with engine.begin() as conn:
        record = enqueue_task(conn, settings)
        assert conn.execute(select(messages.c.id).where(messages.c.idempotency_key == record.idempotency_key)
                            ).scalar_one() == record.id
    assert count_messages(engine) == 1


def test_a_savepoint_rolled_back_takes_what_was_enqueued_in_it(seller_table, settings):
    engine = seller_table
    with Session(engine) as session, session.begin():
        kept = enqueue_task(session, settings, task_id="kept")
        nested = session.begin_nested()
        enqueue_task(session, settings, task_id="dropped")
        nested.rollback()
        after = enqueue_task(session, settings, task_id="after")
    with engine.connect() as conn:
        stored_keys = set(conn.execute(select(messages.c.idempotency_key)).scalars())
    assert stored_keys == {kept.idempotency_key, after.idempotency_key}


def test_a_rollback_drops_it_and_its_id_says_so(seller_table, settings):
    engine = seller_table
    with engine.connect() as conn:
        conn.exec_driver_sql("UPDATE seller_tasks SET status = 'completed' WHERE id = 1")
        record = enqueue_task(conn, settings)
        conn.rollback()
    assert count_messages(engine) == 0
    with pytest.raises(MessageRolledBack):
        record.id


@pytest.mark.parametrize("isolation", [None, "SERIALIZABLE"])
def test_an_enqueue_opening_the_transaction_is_rolled_back_with_what_follows(hooked, settings, isolation):
    """The enqueue is the transaction's first statement, sent ahead of the next one: it must
    open the transaction as that statement would have (with the connection's isolation
    level), not run alone and commit on its own."""
    engine = hooked if isolation is None else hooked.execution_options(isolation_level=isolation)
    with engine.connect() as conn:
        enqueue_task(conn, settings)
        level = conn.exec_driver_sql("SHOW transaction_isolation").scalar_one()
        conn.exec_driver_sql("UPDATE seller_tasks SET status = 'completed' WHERE id = 1")
        conn.rollback()
    assert level == (isolation or "read committed").lower()
    assert count_messages(engine) == 1


def test_reading_the_id_before_the_commit_writes_the_row_in_the_transaction(seller_table, settings):
    engine = seller_table
    with engine.connect() as conn:
        pid = backend_pid(conn)
        record = enqueue_task(conn, settings)
        message_id = record.id
        assert last_statement(engine, pid).startswith("INSERT INTO outbox_messages")
        conn.rollback()
    assert count_messages(engine) == 0 and isinstance(message_id, int)


@pytest.mark.parametrize("how", ["close", "session_close"])
def test_a_connection_put_back_unfinished_carries_nothing_into_the_next_transaction(pg_url, seller_table,
                                                                                    settings, how):
    from outbox.db import make_engine

    engine = make_engine(pg_url, pool_size=1, max_overflow=0)  # the next checkout is the same connection
    try:
        if how == "close":
            conn = engine.connect()
            enqueue_task(conn, settings)
            conn.close()
        else:
            session = Session(engine)
            enqueue_task(session, settings)
            session.close()
        with engine.begin() as conn:
            conn.exec_driver_sql("UPDATE seller_tasks SET status = 'completed' WHERE id = 1")
        assert count_messages(seller_table) == 0
    finally:
        engine.dispose()


def test_an_insert_that_fails_fails_the_commit_and_the_transaction_with_it(refusing, settings):
    """Nothing validation can foresee: here a constraint the producer does not know of."""
    engine = refusing
    with engine.connect() as conn:
        conn.exec_driver_sql("UPDATE seller_tasks SET status = 'completed' WHERE id = 1")
        record = enqueue_task(conn, settings, tenant_id="t_refused")
        with pytest.raises(sqlalchemy.exc.IntegrityError, match="test_refuses_t_refused"):
            conn.commit()
        conn.rollback()
        assert conn.exec_driver_sql("SELECT status FROM seller_tasks").scalar_one() == "working"
        enqueue_task(conn, settings, task_id="next")  # the connection goes on
        conn.commit()
    assert count_messages(engine) == 1
    with pytest.raises(MessageRolledBack):
        record.id


def test_two_enqueues_ride_one_commit(seller_table, settings):
    engine = seller_table
    with Session(engine) as session, session.begin():
        first, second = enqueue_task(session, settings, task_id="a"), enqueue_task(session, settings, task_id="b")
    assert first.id != second.id and {stored.row(engine, r.id).task_id for r in (first, second)} == {"a", "b"}


def test_a_key_the_caller_gave_is_written_at_once(seller_table, settings):
    """A given key may have a twin to return (or a conflict to raise) now, not at the commit."""
    engine = seller_table
    with engine.begin() as conn:
        record = enqueue_task(conn, settings, idempotency_key="whk_given_key_000000001")
        assert "with the COMMIT" not in repr(record)
        assert enqueue_task(conn, settings, idempotency_key="whk_given_key_000000001") == record


def test_autocommit_and_asyncio_connections_write_at_once(pg_url, seller_table, settings):
    engine = seller_table
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        record = enqueue_task(conn, settings, task_id="autocommit")
        assert "with the COMMIT" not in repr(record)
    assert count_messages(engine) == 1

    async def enqueue_async() -> outbox.EnqueuedMessage:
        async_engine = make_async_engine(pg_url)
        try:
            async with async_engine.begin() as conn:
                return await aio.enqueue_task_webhook(
                    conn, tenant_id="t1", push_notification_config=PNC, task_id="aio", task_type="create_media_buy",
                    status="completed", result={"media_buy_id": "mb_1"}, settings=settings)
        finally:
            await async_engine.dispose()

    import asyncio

    assert "with the COMMIT" not in repr(asyncio.run(enqueue_async()))
    assert count_messages(engine) == 2


def test_a_two_phase_transaction_writes_at_once(seller_table, settings):
    """Its PREPARE TRANSACTION and COMMIT PREPARED are no COMMIT to ride."""
    with seller_table.connect() as conn:
        conn.begin_twophase()
        record = enqueue_task(conn, settings)
        assert "with the COMMIT" not in repr(record)
        conn.rollback()


def test_a_minted_key_found_taken_fails_the_commit_rather_than_drop_the_message(seller_table, settings,
                                                                                 monkeypatch):
    """Never expected of a random UUID; were it so, the transaction fails whole."""
    import uuid

    taken = uuid.uuid4()
    monkeypatch.setattr("outbox.producer.uuid.uuid4", lambda: taken)
    engine = seller_table
    with engine.begin() as conn:
        enqueue_task(conn, settings, task_id="first")
    with engine.connect() as conn:
        conn.exec_driver_sql("UPDATE seller_tasks SET status = 'completed' WHERE id = 1")
        enqueue_task(conn, settings, task_id="second")
        with pytest.raises(sqlalchemy.exc.IntegrityError, match="outbox_messages_key_tenant_key"):
            conn.commit()
        conn.rollback()
        assert conn.exec_driver_sql("SELECT status FROM seller_tasks").scalar_one() == "working"
    assert count_messages(engine) == 1


def test_an_orm_change_made_before_the_enqueue_leaves_the_commit_to_carry_the_row_alone(hooked, settings):
    """The session's pending changes are flushed by the enqueue (as a query would flush
    them), so its commit has no flush whose statement the row would have to go before."""
    from sqlalchemy import Column, Integer, Text
    from sqlalchemy.orm import DeclarativeBase

    class Base(DeclarativeBase):
        pass

    class SellerTask(Base):
        __tablename__ = "seller_tasks"
        id = Column(Integer, primary_key=True)
        status = Column(Text)

    engine = hooked
    at_commit: list[str] = []

    def sent(_conn, _cursor, statement, *_rest) -> None:
        at_commit.append(statement)

    with Session(engine) as session:
        with session.begin():
            session.get(SellerTask, 1).status = "completed"
            record = enqueue_task(session, settings)
            event.listen(engine, "before_cursor_execute", sent)
        event.remove(engine, "before_cursor_execute", sent)
    assert at_commit == [] and stored.row(engine, record.id).task_id == "task_1"
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT status FROM seller_tasks").scalar_one() == "completed"


def test_comparing_hashing_and_copying_a_record_send_nothing(hooked, settings):
    import copy

    engine = hooked
    with engine.connect() as conn:
        pid, record = task_after_update(conn, settings)
        assert record == record and record in {record} and copy.copy(record) is record
        assert record != enqueue_task(conn, settings, task_id="other")
        assert last_statement(engine, pid).startswith("UPDATE seller_tasks")
        conn.rollback()
    assert record == record and record in {record} and count_messages(engine) == 1


def test_enqueueing_adds_no_event_listener_to_the_seller_s_engines(hooked, settings):
    """A seller making ``engine.execution_options(...)`` per request (a logging token, a schema
    map) shares its engine's pool: enqueueing through each must add no pool listener per such
    engine, for good (each checkin would call them all). Nor any engine listener: one has
    SQLAlchemy dispatch every event of every statement (30 µs more per transaction)."""
    engine = hooked
    assert not engine._has_events and not engine.dispatch.before_cursor_execute and not engine.dispatch.commit
    resets, invalidates = len(engine.pool.dispatch.reset), len(engine.pool.dispatch.invalidate)
    kept, records = [], []
    for i in range(20):
        per_request = engine.execution_options(logging_token=f"request-{i}")
        kept.append(per_request)
        with per_request.begin() as conn:
            records.append(enqueue_task(conn, settings, task_id=f"task_{i}"))
    assert (len(engine.pool.dispatch.reset), len(engine.pool.dispatch.invalidate)) == (resets, invalidates)
    assert count_messages(engine) == 21 and all(isinstance(record.id, int) for record in records)
    with kept[0].connect() as conn:  # still parked, still dropped by a rollback, still carried by a statement
        dropped = enqueue_task(conn, settings, task_id="dropped")
        conn.rollback()
        seen = enqueue_task(conn, settings, task_id="seen")
        assert conn.execute(select(func.count()).select_from(messages)
                            .where(messages.c.task_id == "seen")).scalar_one() == 1
        conn.commit()
    with pytest.raises(MessageRolledBack):
        dropped.id
    assert isinstance(seen.id, int) and count_messages(engine) == 22


def test_a_body_larger_than_the_socket_s_send_buffer_goes_out_in_turns(seller_table, settings):
    """psycopg's connections do not block: with a small send buffer, the pipeline's bytes leave
    in several writes, each when the socket can take more."""
    import os
    import socket

    engine = seller_table
    with engine.connect() as conn:
        fd = os.dup(conn.connection.driver_connection.pgconn.socket)
        with socket.socket(fileno=fd) as same:  # the connection's own socket, through another descriptor
            same.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        _, record = task_after_update(conn, settings, result={"report": "x" * 900_000})
        conn.commit()
    assert len(stored.row(engine, record.id).body) > 900_000
