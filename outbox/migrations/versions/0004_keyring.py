"""The signing keyring: every scope's keys and their lifecycle, and a change counter.

Revision ID: 0004_keyring
Revises: 0003_breaker_window
Create Date: 2026-12-01

Additive: a daemon one release behind never reads these tables (docs/architecture.md,
"Rolling upgrades").
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrate import record_min_reader

revision = "0004_keyring"
down_revision = "0003_breaker_window"
branch_labels = None
depends_on = None

_Epoch = sa.Float(53)


def upgrade() -> None:
    op.create_table(
        "outbox_signing_keys",
        sa.Column("kid", sa.Text, primary_key=True),
        sa.Column("scope", sa.Text, nullable=False),
        sa.Column("alg", sa.Text, nullable=False),
        sa.Column("key_file", sa.Text, nullable=False),
        sa.Column("public_jwk", sa.Text, nullable=False),
        sa.Column("adcp_use", sa.Text, nullable=False, server_default="request-signing"),
        sa.Column("published_at", _Epoch, nullable=False),
        sa.Column("activates_at", _Epoch),
        sa.Column("deactivates_at", _Epoch),
        sa.Column("unpublish_at", _Epoch),
        sa.Column("revoked_at", _Epoch),
        sa.CheckConstraint("adcp_use IN ('request-signing', 'webhook-signing')",
                           name="outbox_signing_keys_adcp_use_check"),
    )
    op.create_index("outbox_signing_keys_scope_idx", "outbox_signing_keys", ["scope"])
    keyring = op.create_table(
        "outbox_keyring",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("version", sa.BigInteger, nullable=False),
    )
    op.bulk_insert(keyring, [{"id": 1, "version": 0}])
    # Additive: code at the previous revision keeps working on this schema.
    record_min_reader(revision, down_revision)


def downgrade() -> None:
    op.drop_table("outbox_keyring")
    op.drop_table("outbox_signing_keys")
