"""Account-level notification subscribers, fire attribution, and the proof_failed dead reason.

Revision ID: 0005_subscribers
Revises: 0008_sealed_bodies

Additive only (a daemon one release behind keeps working): one new table, nullable
columns, a ``held`` flag that defaults to false, and a wider ``dead_reason`` check.
A held fire is also due only in the far future, so a daemon that predates ``held`` never
claims it either.
"""

from __future__ import annotations


import sqlalchemy as sa
from alembic import op

from outbox.migrate import rebuild_messages_table, record_min_reader
from outbox.schema import PG_NOW, SQLITE_NOW

revision = "0005_subscribers"
down_revision = "0008_sealed_bodies"
branch_labels = None
depends_on = None

_Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_Epoch = sa.Float(53)
_OLD_REASONS = "'expired', 'conflict', 'signature_rejected', 'gone', 'rejected', 'invalid', 'blocked'"
_NEW_COLUMNS = ("principal_id", "account_id", "subscriber_id", "notification_id", "media_buy_id")


def _reason_check(reasons: str) -> str:
    return f"dead_reason IS NULL OR dead_reason IN ({reasons})"


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    now = sa.text(f"({PG_NOW})" if dialect == "postgresql" else f"({SQLITE_NOW})")
    op.create_table(
        "outbox_subscribers",
        sa.Column("id", _Id, primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("account_id", sa.Text, nullable=False),
        sa.Column("subscriber_id", sa.Text, nullable=False),
        sa.Column("principal_id", sa.Text),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("event_types", sa.Text, nullable=False),
        sa.Column("auth_mode", sa.Text, nullable=False, server_default="rfc9421"),
        sa.Column("auth_secret", sa.LargeBinary),
        sa.Column("active", sa.Boolean, nullable=False, server_default=sa.true()),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("config_sha256", sa.Text, nullable=False),
        sa.Column("proven_sha256", sa.Text),
        sa.Column("challenge_message_id", sa.BigInteger),
        sa.Column("created_at", _Epoch, nullable=False, server_default=now),
        sa.Column("updated_at", _Epoch, nullable=False, server_default=now),
        sa.Column("proven_at", _Epoch),
        sa.CheckConstraint("state IN ('pending_proof', 'active', 'paused', 'proof_failed')",
                           name="outbox_subscribers_state_check"),
        sa.CheckConstraint("auth_mode IN ('rfc9421', 'hmac', 'bearer')", name="outbox_subscribers_auth_mode_check"),
    )
    op.create_index("outbox_subscribers_key", "outbox_subscribers", ["tenant_id", "account_id", "subscriber_id"],
                    unique=True)
    op.create_index("outbox_subscribers_challenge_idx", "outbox_subscribers", ["challenge_message_id"])

    held = sa.text("held")
    notification = sa.text("notification_type IS NOT NULL")
    with rebuild_messages_table() as batch:  # SQLite: a CHECK changes only by a rebuild
        for name in _NEW_COLUMNS:
            batch.add_column(sa.Column(name, sa.Text))
        batch.add_column(sa.Column("subscriber_ref", sa.BigInteger))
        batch.add_column(sa.Column("held", sa.Boolean, nullable=False, server_default=sa.false()))
        batch.drop_constraint("outbox_messages_dead_reason_check", type_="check")
        batch.create_check_constraint("outbox_messages_dead_reason_check",
                                      sa.text(_reason_check(_OLD_REASONS + ", 'proof_failed'")))
    op.create_index("outbox_messages_held_idx", "outbox_messages", ["subscriber_ref"],
                    postgresql_where=held, sqlite_where=held)
    # webhook_activity(): a principal's notification fires, newest first (then their attempts).
    op.create_index("outbox_messages_activity_idx", "outbox_messages", ["tenant_id", "principal_id", "created_at"],
                    postgresql_where=notification, sqlite_where=notification)
    # Additive: the previous release keeps delivering (it leaves held fires alone; see
    # docs/subscribers.md, "Known limits", for the challenges it cannot judge).
    record_min_reader(revision, down_revision)


def downgrade() -> None:
    op.execute(sa.text("DELETE FROM outbox_schema_compat WHERE revision = :r").bindparams(r=revision))
    op.drop_index("outbox_messages_activity_idx", "outbox_messages")
    op.drop_index("outbox_messages_held_idx", "outbox_messages")
    with op.batch_alter_table("outbox_messages") as batch:
        batch.drop_constraint("outbox_messages_dead_reason_check", type_="check")
        batch.create_check_constraint("outbox_messages_dead_reason_check", sa.text(_reason_check(_OLD_REASONS)))
        for name in (*_NEW_COLUMNS, "subscriber_ref", "held"):
            batch.drop_column(name)
    op.drop_table("outbox_subscribers")
