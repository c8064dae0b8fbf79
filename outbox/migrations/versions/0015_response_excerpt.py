"""``outbox_attempts.response_excerpt``: the start of a failed answer's body, sanitized and
masked (docs/protocol.md "Attempt records").

Additive: a nullable column. On PostgreSQL ``outbox_attempts`` is partitioned by day; a column
added to the partitioned parent is added to every partition, present and future. Daemons of
the previous release keep inserting rows without it (NULL: no excerpt).

Revision ID: 0015_response_excerpt
Revises: 0014_due_endpoints
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrate import record_additive
from outbox.schema import schema_compat

revision = "0015_response_excerpt"
down_revision = "0014_due_endpoints"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Additive for old readers: they neither read nor write the new column.
    record_additive(revision, down_revision)
    op.add_column("outbox_attempts", sa.Column("response_excerpt", sa.Text()))


def downgrade() -> None:
    op.execute(sa.delete(schema_compat).where(schema_compat.c.revision == revision))
    with op.batch_alter_table("outbox_attempts") as batch:  # SQLite drops a column by a rebuild
        batch.drop_column("response_excerpt")
