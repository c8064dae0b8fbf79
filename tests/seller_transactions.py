"""A seller's transaction on PostgreSQL, for the tests of the commit pipeline
(outbox/commit_pipeline.py): its task webhook, its backend, and what that backend last ran."""

from __future__ import annotations

from sqlalchemy import func, select, text

import outbox
from outbox.schema import messages

PNC = {"url": "https://buyer.example.com/hooks/adcp", "operation_id": "op_1", "token": "tok_abcdefghijklmnop"}


def enqueue_task(conn, settings, **overrides) -> outbox.EnqueuedMessage:
    """The seller's task webhook (a minted key: it rides the commit where it can)."""
    kwargs = dict(tenant_id="t1", push_notification_config=PNC, task_id="task_1", task_type="create_media_buy",
                  status="completed", result={"media_buy_id": "mb_1"}, settings=settings)
    return outbox.enqueue_task_webhook(conn, **{**kwargs, **overrides})


def count_messages(engine) -> int:
    """How many messages are stored, read on a connection of its own."""
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(messages)).scalar_one()


def backend_pid(conn) -> int:
    """The PostgreSQL backend serving ``conn``."""
    return conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()


def last_statement(engine, pid: int) -> str:
    """What the backend ``pid`` last ran, read on another connection."""
    with engine.connect() as other:
        return other.execute(text("SELECT query FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}).scalar_one()


def task_after_update(conn, settings, **overrides) -> tuple[int, outbox.EnqueuedMessage]:
    """The seller's backend, and an enqueue after the seller's own UPDATE of its task."""
    pid = backend_pid(conn)
    conn.exec_driver_sql("UPDATE seller_tasks SET status = 'completed' WHERE id = 1")
    return pid, enqueue_task(conn, settings, **overrides)


def terminate_backend(engine, pid: int) -> None:
    """End backend ``pid`` from another connection, as a failover or an operator would."""
    with engine.connect() as other:
        other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
