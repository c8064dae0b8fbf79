"""When the seller's transaction or its connection fails around a message riding its COMMIT
(outbox/commit_pipeline.py): disconnects, an invalidated or abandoned connection, a commit
that is refused, interrupted or whose answer is lost, another thread reading the id, a
dialect of the seller's own. The message must exist if and only if the transaction commits,
and its record must never say otherwise.
"""

from __future__ import annotations

import gc

import pytest
import sqlalchemy.exc
from sqlalchemy import create_engine, event, select, text
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

import outbox
from outbox.errors import MessageNotWritten, MessageOutcomeUnknown, MessageRolledBack
from outbox.schema import messages
from tests import stored
from tests.seller_transactions import backend_pid, count_messages, enqueue_task, task_after_update, terminate_backend


@pytest.mark.parametrize("how", ["connection", "session"])
def test_a_disconnect_in_a_transaction_stays_a_disconnect_once_the_engine_has_enqueued(hooked, settings, how):
    """An engine an enqueue has hooked raises a disconnect as SQLAlchemy does (invalidated),
    not as the hook's own failure to reach the closed connection."""
    engine = hooked
    with pytest.raises(sqlalchemy.exc.OperationalError) as raised:
        if how == "connection":
            with engine.begin() as conn:
                terminate_backend(engine, backend_pid(conn))
                conn.exec_driver_sql("UPDATE seller_tasks SET status = 'completed' WHERE id = 1")
        else:
            with Session(engine) as session, session.begin():
                terminate_backend(engine, session.execute(text("SELECT pg_backend_pid()")).scalar_one())
                session.execute(text("UPDATE seller_tasks SET status = 'completed' WHERE id = 1"))
    assert raised.value.connection_invalidated
    assert count_messages(engine) == 1


def test_an_invalidated_connection_drops_what_was_parked_on_it(seller_table, settings):
    engine = seller_table
    with engine.connect() as conn:
        record = enqueue_task(conn, settings)
        conn.invalidate()
        conn.rollback()
    with pytest.raises(MessageRolledBack):
        record.id
    assert count_messages(engine) == 0 and "(rolled back)" in repr(record)


def test_an_id_read_early_that_fails_raises_as_sqlalchemy_does(refusing, settings):
    engine = refusing
    with engine.connect() as conn:
        record = enqueue_task(conn, settings, tenant_id="t_refused")
        with pytest.raises(sqlalchemy.exc.IntegrityError, match="test_refuses_t_refused"):
            record.id
        conn.rollback()
        pid = backend_pid(conn)
        record = enqueue_task(conn, settings)
        terminate_backend(engine, pid)
        with pytest.raises(sqlalchemy.exc.OperationalError) as raised:
            record.id
        assert raised.value.connection_invalidated and conn.invalidated
        conn.rollback()
    assert count_messages(engine) == 0


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
            _, record = task_after_update(conn, settings)
            with pytest.raises(Refused):
                conn.commit()
            conn.rollback()
    finally:
        event.remove(engine, "commit", refuse)
    assert count_messages(engine) == 1 and "(rolled back)" in repr(record)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT status FROM seller_tasks").scalar_one() == "working"


def test_an_id_read_on_another_thread_waits_for_the_commit(seller_table, settings):
    """The connection is the enqueuing thread's: another thread never sends on it, it waits."""
    import threading

    engine = seller_table
    for n in range(30):
        with engine.connect() as conn:
            record = enqueue_task(conn, settings, task_id=f"task_{n}")
            seen: list[object] = []
            reader = threading.Thread(target=lambda: seen.append(record.id))
            reader.start()
            reader.join(0.01)
            assert reader.is_alive()  # waiting for the transaction to end
            conn.commit()
            reader.join(10)
        assert seen == [stored.row(engine, record.id).id]
    assert count_messages(engine) == 30


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
        pids.append(backend_pid(conn))
        conn.exec_driver_sql("UPDATE seller_tasks SET status = 'completed' WHERE id = 1")
        return enqueue_task(conn, settings)  # the connection is dropped here, unfinished

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
        assert count_messages(seller_table) == 0
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
                record = enqueue_task(conn, settings)
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
        return task_after_update(conn, settings)[1]  # the connection is dropped here, unfinished

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
        assert status == "working" and count_messages(seller_table) == 0
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
            _, record = task_after_update(conn, settings)
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
                _, record = task_after_update(conn, settings)
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


def test_a_commit_on_the_driver_connection_carries_the_row(seller_table, settings):
    """A seller that commits on psycopg's own connection commits the message with its
    transaction, not with the connection's next one."""
    engine = seller_table
    with engine.connect() as conn:
        _, record = task_after_update(conn, settings)
        conn.connection.driver_connection.commit()
        assert count_messages(engine) == 1 and isinstance(record.id, int)
        conn.exec_driver_sql("UPDATE seller_tasks SET status = 'failed' WHERE id = 1")
        conn.rollback()
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT status FROM seller_tasks").scalar_one() == "completed"
        assert conn.execute(select(messages.c.id)).scalars().all() == [record.id]


def test_a_rollback_on_the_driver_connection_drops_the_row(seller_table, settings):
    """Rolled back on psycopg's own connection, the message is gone with its transaction: the
    connection's next transaction, committed, does not write it."""
    engine = seller_table
    with engine.connect() as conn:
        _, record = task_after_update(conn, settings)
        conn.connection.driver_connection.rollback()
        conn.exec_driver_sql("UPDATE seller_tasks SET status = 'failed' WHERE id = 1")
        conn.commit()
    with pytest.raises(MessageRolledBack):
        record.id
    assert count_messages(engine) == 0


def test_a_transaction_ended_by_a_driver_statement_never_writes_its_row_into_the_next(seller_table, settings,
                                                                                      caplog):
    """A ``COMMIT`` sent as a statement on the driver connection ends the transaction where no
    wrapper sees it: the row, never sent, is dropped and said (an error logged, ``id`` raises),
    not written by the connection's next transaction."""
    engine = seller_table
    with engine.connect() as conn:
        _, record = task_after_update(conn, settings)
        conn.connection.driver_connection.execute("COMMIT")
        conn.exec_driver_sql("UPDATE seller_tasks SET status = 'failed' WHERE id = 1")
        conn.commit()
    with pytest.raises(MessageNotWritten, match="ended outside SQLAlchemy"):
        record.id
    assert count_messages(engine) == 0
    assert any(r.levelname == "ERROR" and record.idempotency_key in r.getMessage() for r in caplog.records)


def test_a_connection_dropped_unfinished_in_a_shared_pool_drops_the_row(pg_url, seller_table, settings):
    """Two engines on one pool: the pool rolls back a connection dropped unfinished through
    the dialect of the engine made last, which never enqueued; the row parked by the other
    engine goes with that rollback, not with the connection's next transaction."""
    first = create_engine(pg_url, pool_size=1, max_overflow=0)
    second = create_engine(pg_url, pool=first.pool)  # the pool now resets through second's dialect
    try:
        conn = first.connect()
        _, record = task_after_update(conn, settings)
        del conn  # dropped unfinished: the pool's reset rolls it back
        gc.collect()
        with first.begin() as again:
            again.exec_driver_sql("SELECT 1")
        with pytest.raises(MessageRolledBack):
            record.id
        assert count_messages(first) == 0
    finally:
        second.dispose()
        first.dispose()
