"""Endpoint health (a per-minute rollup per endpoint), trace context, operator events
(docs/observability.md).

The completer adds each flush's counts to its own row of the minute (one row per endpoint,
minute and daemon, so replicas never wait on each other's rows), in the flush's
transaction; ``outboxd endpoints`` sums the rows of a window. Reading health then costs
the window's rows, never the attempt history. A message keeps the W3C ``traceparent`` of
the enqueue; an attempt row keeps the ids of its span. Additive: an older daemon writes no
rollup and no span ids, and an older producer no trace context. An operator event is a
row whose unique key says which state change it is, so of several replicas noticing the
same change one inserts it. A recovery job is a row its daemon advances chunk by chunk,
each replayed message recorded once per job.

Revision ID: 0011_observability
Revises: 0009_encryption_keys
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrate import record_additive
from outbox.schema import LATENCY_BOUNDS_MS

revision = "0011_observability"
down_revision = "0009_encryption_keys"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox_endpoint_stats",
        sa.Column("minute", sa.BigInteger(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("origin", sa.Text(), nullable=False),
        sa.Column("daemon_id", sa.Text(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("successes", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("deaths", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("latency_ms_sum", sa.BigInteger(), nullable=False, server_default="0"),
        *(sa.Column(f"le_{i}", sa.Integer(), nullable=False, server_default="0")
          for i in range(len(LATENCY_BOUNDS_MS) + 1)),
        sa.PrimaryKeyConstraint("minute", "tenant_id", "origin", "daemon_id", name="outbox_endpoint_stats_pkey"),
    )
    op.create_table(
        "outbox_operator_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("dedup_key", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text()),
        sa.Column("origin", sa.Text()),
        sa.Column("detail", sa.Text(), nullable=False, server_default="{}"),
        sa.Column("count", sa.Integer(), nullable=False, server_default="1"),
        sa.Column("first_at", sa.Float(53), nullable=False),
        sa.Column("last_at", sa.Float(53), nullable=False),
        sa.Column("due_at", sa.Float(53), nullable=False),
        sa.Column("published_at", sa.Float(53)),
        sa.Column("message_id", sa.BigInteger()),
    )
    op.create_index("outbox_operator_events_dedup_key", "outbox_operator_events", ["dedup_key"], unique=True)
    op.create_index("outbox_operator_events_due_idx", "outbox_operator_events", ["due_at"],
                    postgresql_where=sa.text("published_at IS NULL"), sqlite_where=sa.text("published_at IS NULL"))
    op.create_table(
        "outbox_jobs",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("origin", sa.Text()),
        sa.Column("reason", sa.Text()),
        sa.Column("since", sa.Float(53), nullable=False),
        sa.Column("until", sa.Float(53), nullable=False),
        sa.Column("force", sa.Boolean(), nullable=False),
        sa.Column("rate", sa.Float(53), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("done", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("skipped", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("cursor", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("leased_by", sa.Text()),
        sa.Column("lease_until", sa.Float(53)),
        sa.Column("created_at", sa.Float(53), nullable=False),
        sa.Column("updated_at", sa.Float(53), nullable=False),
        sa.CheckConstraint("state IN ('running', 'paused', 'cancelled', 'done')", name="outbox_jobs_state_check"),
    )
    op.create_table(
        "outbox_job_items",
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("message_id", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "message_id", name="outbox_job_items_pkey"),
    )
    op.add_column("outbox_messages", sa.Column("traceparent", sa.Text(), nullable=True))
    op.add_column("outbox_attempts", sa.Column("trace_id", sa.Text(), nullable=True))
    op.add_column("outbox_attempts", sa.Column("span_id", sa.Text(), nullable=True))
    record_additive(revision, down_revision)


def downgrade() -> None:
    op.drop_column("outbox_attempts", "span_id")
    op.drop_column("outbox_attempts", "trace_id")
    op.drop_column("outbox_messages", "traceparent")
    op.drop_table("outbox_operator_events")
    op.drop_table("outbox_job_items")
    op.drop_table("outbox_jobs")
    op.drop_table("outbox_endpoint_stats")
