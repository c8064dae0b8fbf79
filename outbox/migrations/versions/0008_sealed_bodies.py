"""Sealed webhook bodies: the id of the key a body is sealed under (NULL: plaintext).

Additive, so daemons of the previous release keep working. They cannot open a sealed
body, though, so upgrade the daemons before the producers (docs/encryption.md).

Revision ID: 0008_sealed_bodies
Revises: 0002_tenant_identity
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrate import record_min_reader

revision = "0008_sealed_bodies"
down_revision = "0002_tenant_identity"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("outbox_messages", sa.Column("body_key_id", sa.Text(), nullable=True))
    op.create_index("outbox_messages_body_key_idx", "outbox_messages", ["body_key_id", "id"])
    record_min_reader(revision, down_revision)


def downgrade() -> None:
    op.drop_index("outbox_messages_body_key_idx", "outbox_messages")
    op.drop_column("outbox_messages", "body_key_id")
