"""Endpoint health: a per-minute rollup of attempts, outcomes and latency per endpoint.

The completer adds each flush's counts to its own row of the minute (one row per endpoint,
minute and daemon, so replicas never wait on each other's rows), in the flush's
transaction; ``outboxd endpoints`` sums the rows of a window. Reading health then costs
the window's rows, never the attempt history (docs/observability.md). Additive: an older
daemon simply writes no rollup.

Revision ID: 0011_observability
Revises: 0007_attempt_partitions
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrate import record_min_reader
from outbox.schema import LATENCY_BOUNDS_MS

revision = "0011_observability"
down_revision = "0007_attempt_partitions"
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
    record_min_reader(revision, down_revision)


def downgrade() -> None:
    op.drop_table("outbox_endpoint_stats")
