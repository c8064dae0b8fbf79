"""Breakers judge a failure rate over a window; transitions are logged; claims find due work per endpoint.

Additive only (a daemon one release behind keeps working): five window counters on
``outbox_breakers`` (with defaults), the ``outbox_breaker_transitions`` log, and two
partial indexes on pending messages: one per endpoint in due order (the claim walks each
endpoint's due head) and one by enqueue time (the expiry sweep finds what is past its
horizon without reading the whole backlog).

Revision ID: 0003_breaker_window
Revises: 0006_reader_revision
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrate import record_min_reader
from outbox.schema import PG_NOW, SQLITE_NOW

revision = "0003_breaker_window"
down_revision = "0006_reader_revision"
branch_labels = None
depends_on = None

_Epoch = sa.Float(53)
_Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    now = sa.text(f"({PG_NOW})" if dialect == "postgresql" else f"({SQLITE_NOW})")
    pending = sa.text("state = 'pending'")
    with op.batch_alter_table("outbox_breakers") as batch:
        batch.add_column(sa.Column("window_started_at", _Epoch))
        for name in ("window_attempts", "window_failures", "previous_attempts", "previous_failures"):
            batch.add_column(sa.Column(name, sa.Integer, nullable=False, server_default="0"))
    op.create_table(
        "outbox_breaker_transitions",
        sa.Column("id", _Id, primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("origin", sa.Text, nullable=False),
        sa.Column("from_state", sa.Text, nullable=False),
        sa.Column("to_state", sa.Text, nullable=False),
        sa.Column("window_attempts", sa.Float(53)),
        sa.Column("window_failures", sa.Float(53)),
        sa.Column("open_until", _Epoch),
        sa.Column("daemon_id", sa.Text),
        sa.Column("occurred_at", _Epoch, nullable=False, server_default=now),
    )
    op.create_index("outbox_breaker_transitions_key_idx", "outbox_breaker_transitions",
                    ["tenant_id", "origin", "occurred_at"])
    op.create_index("outbox_messages_endpoint_due_idx", "outbox_messages",
                    ["tenant_id", sa.text("COALESCE(origin, '')"), "next_attempt_at", "id"],
                    postgresql_where=pending, sqlite_where=pending)
    op.create_index("outbox_messages_pending_created_idx", "outbox_messages", ["created_at"],
                    postgresql_where=pending, sqlite_where=pending)
    # Additive: code at the previous revision keeps working on this schema.
    record_min_reader(revision, down_revision)


def downgrade() -> None:
    op.drop_index("outbox_messages_pending_created_idx", "outbox_messages")
    op.drop_index("outbox_messages_endpoint_due_idx", "outbox_messages")
    op.drop_table("outbox_breaker_transitions")
    with op.batch_alter_table("outbox_breakers") as batch:
        for name in ("previous_failures", "previous_attempts", "window_failures", "window_attempts",
                     "window_started_at"):
            batch.drop_column(name)
