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
from sqlalchemy import create_engine, event, func, select, text
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

import outbox
from outbox import aio
from outbox.db import make_async_engine
from outbox.errors import MessageOutcomeUnknown, MessageRolledBack
from outbox.schema import messages
from tests import stored

PNC = {"url": "https://buyer.example.com/hooks/adcp", "operation_id": "op_1", "token": "tok_abcdefghijklmnop"}


def _task(conn, settings, **overrides) -> outbox.EnqueuedMessage:
    kwargs = dict(tenant_id="t1", push_notification_config=PNC, task_id="task_1", task_type="create_media_buy",
                  status="completed", result={"media_buy_id": "mb_1"}, settings=settings)
    return outbox.enqueue_task_webhook(conn, **{**kwargs, **overrides})


def _count(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(messages)).scalar_one()


def _backend(conn) -> int:
    return conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()


def _last_statement(engine, pid: int) -> str:
    """What the backend ``pid`` last ran, read on another connection."""
    with engine.connect() as other:
        return other.execute(text("SELECT query FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}).scalar_one()


@pytest.fixture
def seller_table(pg_engine):
    with pg_engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS seller_tasks (id int PRIMARY KEY, status text)")
        conn.exec_driver_sql("DELETE FROM seller_tasks")
        conn.exec_driver_sql("INSERT INTO seller_tasks VALUES (1, 'working')")
    yield pg_engine
    with pg_engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE seller_tasks")


@pytest.fixture
def hooked(seller_table, settings):
    """The seller's engine after its first enqueue, which reads which columns the schema has
    and hooks the engine: one message stored."""
    with seller_table.begin() as conn:
        _task(conn, settings, task_id="first")
    return seller_table


@pytest.fixture
def refusing(seller_table):
    """The seller's engine while ``outbox_messages`` refuses tenant ``t_refused``: an INSERT
    failure nothing in the producer's validation can foresee."""
    with seller_table.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE outbox_messages ADD CONSTRAINT test_refuses_t_refused "
                             "CHECK (tenant_id <> 't_refused') NOT VALID")
    yield seller_table
    with seller_table.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE outbox_messages DROP CONSTRAINT test_refuses_t_refused")


def _task_after_update(conn, settings, **overrides) -> tuple[int, outbox.EnqueuedMessage]:
    """The seller's backend, and an enqueue after the seller's own UPDATE of its task."""
    pid = _backend(conn)
    conn.exec_driver_sql("UPDATE seller_tasks SET status = 'completed' WHERE id = 1")
    return pid, _task(conn, settings, **overrides)


def test_the_insert_goes_with_the_commit_and_the_id_comes_back_with_it(hooked, settings):
    engine = hooked
    with engine.connect() as conn:
        pid, record = _task_after_update(conn, settings)
        assert _last_statement(engine, pid).startswith("UPDATE seller_tasks")  # nothing sent for the enqueue yet
        assert "with the COMMIT" in repr(record)
        conn.commit()
        assert _last_statement(engine, pid) == "COMMIT"
    assert _count(engine) == 2
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
        record = _task(conn, settings)
        conn.commit()
    assert stored.row(engine, record.id).task_id == "task_1"


def test_a_later_statement_of_the_transaction_sees_the_row(seller_table, settings):
    engine = seller_table
    with engine.begin() as conn:
        record = _task(conn, settings)
        assert conn.execute(select(messages.c.id).where(messages.c.idempotency_key == record.idempotency_key)
                            ).scalar_one() == record.id
    assert _count(engine) == 1


def test_a_savepoint_rolled_back_takes_what_was_enqueued_in_it(seller_table, settings):
    engine = seller_table
    with Session(engine) as session, session.begin():
        kept = _task(session, settings, task_id="kept")
        nested = session.begin_nested()
        _task(session, settings, task_id="dropped")
        nested.rollback()
        after = _task(session, settings, task_id="after")
    with engine.connect() as conn:
        stored_keys = set(conn.execute(select(messages.c.idempotency_key)).scalars())
    assert stored_keys == {kept.idempotency_key, after.idempotency_key}


def test_a_rollback_drops_it_and_its_id_says_so(seller_table, settings):
    engine = seller_table
    with engine.connect() as conn:
        conn.exec_driver_sql("UPDATE seller_tasks SET status = 'completed' WHERE id = 1")
        record = _task(conn, settings)
        conn.rollback()
    assert _count(engine) == 0
    with pytest.raises(MessageRolledBack):
        record.id


def test_reading_the_id_before_the_commit_writes_the_row_in_the_transaction(seller_table, settings):
    engine = seller_table
    with engine.connect() as conn:
        pid = _backend(conn)
        record = _task(conn, settings)
        message_id = record.id
        assert _last_statement(engine, pid).startswith("INSERT INTO outbox_messages")
        conn.rollback()
    assert _count(engine) == 0 and isinstance(message_id, int)


@pytest.mark.parametrize("how", ["close", "session_close"])
def test_a_connection_put_back_unfinished_carries_nothing_into_the_next_transaction(pg_url, seller_table,
                                                                                    settings, how):
    from outbox.db import make_engine

    engine = make_engine(pg_url, pool_size=1, max_overflow=0)  # the next checkout is the same connection
    try:
        if how == "close":
            conn = engine.connect()
            _task(conn, settings)
            conn.close()
        else:
            session = Session(engine)
            _task(session, settings)
            session.close()
        with engine.begin() as conn:
            conn.exec_driver_sql("UPDATE seller_tasks SET status = 'completed' WHERE id = 1")
        assert _count(seller_table) == 0
    finally:
        engine.dispose()


def test_an_insert_that_fails_fails_the_commit_and_the_transaction_with_it(refusing, settings):
    """Nothing validation can foresee: here a constraint the producer does not know of."""
    engine = refusing
    with engine.connect() as conn:
        conn.exec_driver_sql("UPDATE seller_tasks SET status = 'completed' WHERE id = 1")
        record = _task(conn, settings, tenant_id="t_refused")
        with pytest.raises(sqlalchemy.exc.IntegrityError, match="test_refuses_t_refused"):
            conn.commit()
        conn.rollback()
        assert conn.exec_driver_sql("SELECT status FROM seller_tasks").scalar_one() == "working"
        _task(conn, settings, task_id="next")  # the connection goes on
        conn.commit()
    assert _count(engine) == 1
    with pytest.raises(MessageRolledBack):
        record.id


def test_two_enqueues_ride_one_commit(seller_table, settings):
    engine = seller_table
    with Session(engine) as session, session.begin():
        first, second = _task(session, settings, task_id="a"), _task(session, settings, task_id="b")
    assert first.id != second.id and {stored.row(engine, r.id).task_id for r in (first, second)} == {"a", "b"}


def test_a_key_the_caller_gave_is_written_at_once(seller_table, settings):
    """A given key may have a twin to return (or a conflict to raise) now, not at the commit."""
    engine = seller_table
    with engine.begin() as conn:
        record = _task(conn, settings, idempotency_key="whk_given_key_000000001")
        assert "with the COMMIT" not in repr(record)
        assert _task(conn, settings, idempotency_key="whk_given_key_000000001") == record


def test_autocommit_and_asyncio_connections_write_at_once(pg_url, seller_table, settings):
    engine = seller_table
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        record = _task(conn, settings, task_id="autocommit")
        assert "with the COMMIT" not in repr(record)
    assert _count(engine) == 1

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
    assert _count(engine) == 2


def test_a_two_phase_transaction_writes_at_once(seller_table, settings):
    """Its PREPARE TRANSACTION and COMMIT PREPARED are no COMMIT to ride."""
    with seller_table.connect() as conn:
        conn.begin_twophase()
        record = _task(conn, settings)
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
        _task(conn, settings, task_id="first")
    with engine.connect() as conn:
        conn.exec_driver_sql("UPDATE seller_tasks SET status = 'completed' WHERE id = 1")
        _task(conn, settings, task_id="second")
        with pytest.raises(sqlalchemy.exc.IntegrityError, match="outbox_messages_key_tenant_key"):
            conn.commit()
        conn.rollback()
        assert conn.exec_driver_sql("SELECT status FROM seller_tasks").scalar_one() == "working"
    assert _count(engine) == 1


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
            record = _task(session, settings)
            event.listen(engine, "before_cursor_execute", sent)
        event.remove(engine, "before_cursor_execute", sent)
    assert at_commit == [] and stored.row(engine, record.id).task_id == "task_1"
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT status FROM seller_tasks").scalar_one() == "completed"


def _terminate(engine, pid: int) -> None:
    with engine.connect() as other:
        other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})


@pytest.mark.parametrize("how", ["connection", "session"])
def test_a_disconnect_in_a_transaction_stays_a_disconnect_once_the_engine_has_enqueued(hooked, settings, how):
    """An engine an enqueue has hooked raises a disconnect as SQLAlchemy does (invalidated),
    not as the hook's own failure to reach the closed connection."""
    engine = hooked
    with pytest.raises(sqlalchemy.exc.OperationalError) as raised:
        if how == "connection":
            with engine.begin() as conn:
                _terminate(engine, _backend(conn))
                conn.exec_driver_sql("UPDATE seller_tasks SET status = 'completed' WHERE id = 1")
        else:
            with Session(engine) as session, session.begin():
                _terminate(engine, session.execute(text("SELECT pg_backend_pid()")).scalar_one())
                session.execute(text("UPDATE seller_tasks SET status = 'completed' WHERE id = 1"))
    assert raised.value.connection_invalidated
    assert _count(engine) == 1


def test_an_invalidated_connection_drops_what_was_parked_on_it(seller_table, settings):
    engine = seller_table
    with engine.connect() as conn:
        record = _task(conn, settings)
        conn.invalidate()
        conn.rollback()
    with pytest.raises(MessageRolledBack):
        record.id
    assert _count(engine) == 0 and "(rolled back)" in repr(record)


def test_an_id_read_early_that_fails_raises_as_sqlalchemy_does(refusing, settings):
    engine = refusing
    with engine.connect() as conn:
        record = _task(conn, settings, tenant_id="t_refused")
        with pytest.raises(sqlalchemy.exc.IntegrityError, match="test_refuses_t_refused"):
            record.id
        conn.rollback()
        pid = _backend(conn)
        record = _task(conn, settings)
        _terminate(engine, pid)
        with pytest.raises(sqlalchemy.exc.OperationalError) as raised:
            record.id
        assert raised.value.connection_invalidated and conn.invalidated
        conn.rollback()
    assert _count(engine) == 0


def test_a_commit_listener_that_refuses_the_commit_stops_the_row_too(hooked, settings):
    """The row goes where SQLAlchemy commits, after every commit listener, even one the seller
    registered after the engine's first enqueue."""
    engine = hooked

    class Refused(Exception):
        pass

    def refuse(_conn) -> None:
        raise Refused()

    event.listen(engine, "commit", refuse)
    try:
        with engine.connect() as conn:
            _, record = _task_after_update(conn, settings)
            with pytest.raises(Refused):
                conn.commit()
            conn.rollback()
    finally:
        event.remove(engine, "commit", refuse)
    assert _count(engine) == 1 and "(rolled back)" in repr(record)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT status FROM seller_tasks").scalar_one() == "working"


def test_an_id_read_on_another_thread_waits_for_the_commit(seller_table, settings):
    """The connection is the enqueuing thread's: another thread never sends on it, it waits."""
    import threading

    engine = seller_table
    for n in range(30):
        with engine.connect() as conn:
            record = _task(conn, settings, task_id=f"task_{n}")
            seen: list[object] = []
            reader = threading.Thread(target=lambda: seen.append(record.id))
            reader.start()
            reader.join(0.01)
            assert reader.is_alive()  # waiting for the transaction to end
            conn.commit()
            reader.join(10)
        assert seen == [stored.row(engine, record.id).id]
    assert _count(engine) == 30


def test_comparing_hashing_and_copying_a_record_send_nothing(hooked, settings):
    import copy

    engine = hooked
    with engine.connect() as conn:
        pid, record = _task_after_update(conn, settings)
        assert record == record and record in {record} and copy.copy(record) is record
        assert record != _task(conn, settings, task_id="other")
        assert _last_statement(engine, pid).startswith("UPDATE seller_tasks")
        conn.rollback()
    assert record == record and record in {record} and _count(engine) == 1


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
            records.append(_task(conn, settings, task_id=f"task_{i}"))
    assert (len(engine.pool.dispatch.reset), len(engine.pool.dispatch.invalidate)) == (resets, invalidates)
    assert _count(engine) == 21 and all(isinstance(record.id, int) for record in records)
    with kept[0].connect() as conn:  # still parked, still dropped by a rollback, still carried by a statement
        dropped = _task(conn, settings, task_id="dropped")
        conn.rollback()
        seen = _task(conn, settings, task_id="seen")
        assert conn.execute(select(func.count()).select_from(messages)
                            .where(messages.c.task_id == "seen")).scalar_one() == 1
        conn.commit()
    with pytest.raises(MessageRolledBack):
        dropped.id
    assert isinstance(seen.id, int) and _count(engine) == 22


def test_a_connection_dropped_unfinished_goes_back_to_the_pool_while_its_record_is_kept(pg_url, seller_table,
                                                                                          settings):
    """A connection the seller drops without closing it (an exception path) is rolled back and
    returned by SQLAlchemy when collected; what is parked on it must not keep it checked out,
    its transaction open and its row locks held, for as long as the record is kept."""
    import gc
    import warnings

    from outbox.db import make_engine

    engine = make_engine(pg_url, pool_size=1, max_overflow=0, pool_timeout=2)
    pids = []

    def request() -> outbox.EnqueuedMessage:
        conn = engine.connect()
        pids.append(_backend(conn))
        conn.exec_driver_sql("UPDATE seller_tasks SET status = 'completed' WHERE id = 1")
        return _task(conn, settings)  # the connection is dropped here, unfinished

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SQLAlchemy's and psycopg's about the connection dropped unclosed
            record = request()
            gc.collect()
        assert engine.pool.checkedout() == 0
        with engine.connect() as conn:  # the pool's one connection, its lock released
            conn.exec_driver_sql("SET LOCAL lock_timeout = '2s'")
            conn.exec_driver_sql("UPDATE seller_tasks SET status = 'other' WHERE id = 1")
            conn.commit()
        with pytest.raises(MessageRolledBack):
            record.id
        assert _count(seller_table) == 0
    finally:
        with seller_table.connect() as other:  # a session left open would hold the lock the teardown waits for
            other.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                               "WHERE pid = ANY(:pids) AND state LIKE 'idle in transaction%'"), {"pids": pids})
        engine.dispose()


def test_a_commit_whose_answer_is_lost_leaves_the_id_unknown_not_rolled_back(pg_url, seller_table, settings):
    """The connection lost after the server committed, before the client heard so: the seller's
    commit raises a disconnect (as it would without the outbox), and the record must not say
    the message does not exist when it does (a seller enqueueing again would send it twice)."""
    from outbox.db import make_engine
    from tests.db_proxies import CommitAnswerCuttingProxy, stalling_proxy

    with stalling_proxy(pg_url, CommitAnswerCuttingProxy) as (proxy, url):
        engine = make_engine(url)
        try:
            with engine.connect() as conn:
                record = _task(conn, settings)
                proxy.arm()
                with pytest.raises(sqlalchemy.exc.OperationalError) as raised:
                    conn.commit()
            assert proxy.cut.is_set() and raised.value.connection_invalidated
        finally:
            engine.dispose()
    with seller_table.connect() as conn:
        stored_id = conn.execute(select(messages.c.id)
                                 .where(messages.c.idempotency_key == record.idempotency_key)).scalar_one()
    assert isinstance(stored_id, int)  # the server committed it
    with pytest.raises(Exception) as asked:
        record.id
    assert not isinstance(asked.value, MessageRolledBack), f"the stored message {stored_id} is said not to exist"
    from outbox.errors import MessageOutcomeUnknown

    assert isinstance(asked.value, MessageOutcomeUnknown) and asked.value.idempotency_key == record.idempotency_key
    assert "(COMMIT unanswered)" in repr(record)


@pytest.mark.parametrize("reset", ["rollback", "commit"])
def test_a_connection_dropped_unfinished_ends_with_its_rows_as_the_pool_ends_its_transaction(pg_url, seller_table,
                                                                                              settings, reset):
    """The pool rolls back (the default) or commits a connection dropped without closing:
    the parked row goes the way of the seller's UPDATE in the same transaction."""
    import gc
    import warnings

    from outbox.db import make_engine

    engine = make_engine(pg_url, pool_size=1, max_overflow=0, pool_reset_on_return=reset)

    def request() -> outbox.EnqueuedMessage:
        conn = engine.connect()
        return _task_after_update(conn, settings)[1]  # the connection is dropped here, unfinished

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SQLAlchemy's and psycopg's about the connection dropped unclosed
            record = request()
            gc.collect()
        with engine.connect() as conn:
            status = conn.exec_driver_sql("SELECT status FROM seller_tasks").scalar_one()
    finally:
        engine.dispose()
    if reset == "commit":
        assert status == "completed" and stored.row(seller_table, record.id).task_id == "task_1"
    else:
        assert status == "working" and _count(seller_table) == 0
        with pytest.raises(MessageRolledBack):
            record.id


class AuditedDialect(PGDialect_psycopg):
    """A seller's dialect with a commit of its own (an audit, a retry, a metric)."""

    supports_statement_cache = True
    commits: list[str] = []

    def do_commit(self, dbapi_connection) -> None:
        self.commits.append("commit")
        super().do_commit(dbapi_connection)


def test_a_dialect_with_a_commit_of_its_own_has_it_called(pg_url, seller_table, settings):
    registry.register("postgresql.audited", __name__, "AuditedDialect")
    engine = create_engine(make_url(pg_url).set(drivername="postgresql+audited"))
    try:
        with engine.connect() as conn:
            _, record = _task_after_update(conn, settings)
            conn.commit()
        assert AuditedDialect.commits == ["commit"]
        assert stored.row(seller_table, record.id).task_id == "task_1"
    finally:
        engine.dispose()


def test_an_interrupt_inside_the_commit_s_pipeline_discards_the_connection(hooked, settings):
    """A signal's exception (Ctrl-C, a service manager's SIGTERM turned into one) landing while
    the pipeline waits for its answers left the connection in pipeline mode, busy: every
    later statement on it, the pool's own rollback included, failed."""
    import signal

    class Interrupted(Exception):
        pass

    def interrupt(*_args) -> None:
        raise Interrupted()

    engine = hooked
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE FUNCTION test_slow_insert() RETURNS trigger LANGUAGE plpgsql AS "
                             "$$ BEGIN PERFORM pg_sleep(0.5); RETURN NEW; END $$")
        conn.exec_driver_sql("CREATE TRIGGER test_slow_insert BEFORE INSERT ON outbox_messages "
                             "FOR EACH ROW EXECUTE FUNCTION test_slow_insert()")
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with pytest.raises(Interrupted):
            with engine.connect() as conn:
                _, record = _task_after_update(conn, settings)
                signal.setitimer(signal.ITIMER_REAL, 0.2)  # while the commit's pipeline waits
                conn.commit()
        with pytest.raises(MessageOutcomeUnknown):
            record.id
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        with engine.begin() as conn:  # the pool goes on with a connection that works
            conn.exec_driver_sql("DROP TRIGGER test_slow_insert ON outbox_messages")
            conn.exec_driver_sql("DROP FUNCTION test_slow_insert()")
