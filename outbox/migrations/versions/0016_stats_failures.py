"""``outbox_endpoint_stats.failures`` and ``latency_ms_max``: per minute, the attempts that
failed at the receiver (failed, timeout, connection_error; not the daemon's own ``abandoned``)
and the slowest answer, so the console's charts and rates read the rollup, never the attempt
history (docs/console.md "The charts"); and an index by endpoint and minute, so a tenant's
or an endpoint's chart reads its own minutes, not every endpoint's.

Additive: two columns with a default, and an index. Daemons of the previous release keep adding to their
rows without them (0): their failures and slowest answers are missing from the charts until
every daemon runs this release (docs/architecture.md "Rolling upgrades").

Revision ID: 0016_stats_failures
Revises: 0015_response_excerpt
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrate import record_additive
from outbox.schema import schema_compat

revision = "0016_stats_failures"
down_revision = "0015_response_excerpt"
branch_labels = None
depends_on = None

COLUMNS = ("failures", "latency_ms_max")
INDEX = "outbox_endpoint_stats_endpoint_idx"


def upgrade() -> None:
    # Additive for old readers: they neither read nor write the new columns.
    record_additive(revision, down_revision)
    for name in COLUMNS:
        op.add_column("outbox_endpoint_stats", sa.Column(name, sa.Integer(), nullable=False, server_default="0"))
    # The table holds a day of minutes (about a million rows at most): a plain build is brief.
    op.create_index(INDEX, "outbox_endpoint_stats", ["tenant_id", "origin", "minute"])


def downgrade() -> None:
    op.execute(sa.delete(schema_compat).where(schema_compat.c.revision == revision))
    op.drop_index(INDEX, "outbox_endpoint_stats")
    with op.batch_alter_table("outbox_endpoint_stats") as batch:  # SQLite drops a column by a rebuild
        for name in COLUMNS:
            batch.drop_column(name)
