"""Body-encryption keys agreed through the database: announced keys and the processes reading them.

Revision ID: 0009_encryption_keys
Revises: 0007_attempt_partitions
Create Date: 2026-12-02

Additive: a daemon of the previous release never reads these tables and keeps delivering
(docs/architecture.md, "Rolling upgrades"). It does not report what it can open, so a new
key does not start sealing while one of its leases or attempts is recent
(docs/encryption.md, "Mixed releases").
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrate import record_additive

revision = "0009_encryption_keys"
down_revision = "0007_attempt_partitions"
branch_labels = None
depends_on = None

_Epoch = sa.Float(53)


def upgrade() -> None:
    op.create_table(
        "outbox_encryption_keys",
        sa.Column("key_id", sa.Text, primary_key=True),
        sa.Column("announced_at", _Epoch, nullable=False),
        sa.Column("seals_from", _Epoch),
    )
    op.create_table(
        "outbox_encryption_readers",
        sa.Column("reader_id", sa.Text, primary_key=True),
        sa.Column("role", sa.Text, nullable=False),
        sa.Column("key_ids", sa.Text, nullable=False),
        sa.Column("sealing_key_id", sa.Text),
        sa.Column("unopenable", sa.Integer, nullable=False, server_default="0"),
        sa.Column("seen_at", _Epoch, nullable=False),
    )
    record_additive(revision, down_revision)


def downgrade() -> None:
    op.drop_table("outbox_encryption_readers")
    op.drop_table("outbox_encryption_keys")
