"""Record, per migration, the oldest code revision that can still run on the schema.

Revision ID: 0006_reader_revision
Revises: 0001

The table is what makes rolling upgrades safe: a daemon whose code is at an older
revision reads the row of the database's revision and keeps running when its own
revision is at least the recorded minimum reader (docs/architecture.md, "Rolling
upgrades"). Purely additive: older code never touches it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrate import record_min_reader

revision = "0006_reader_revision"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox_schema_compat",
        sa.Column("revision", sa.Text, primary_key=True),
        sa.Column("min_reader_revision", sa.Text, nullable=False),
    )
    # Additive: code at the previous revision keeps working on this schema.
    record_min_reader(revision, down_revision)


def downgrade() -> None:
    op.drop_table("outbox_schema_compat")
