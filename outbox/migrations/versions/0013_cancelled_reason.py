"""The ``cancelled`` dead reason: a pending message whose subscriber was revoked.

Revision ID: 0013_cancelled_reason
Revises: 0011_observability

Additive (a wider ``dead_reason`` check): a daemon one release behind keeps delivering and
never writes the new reason itself.
"""

from __future__ import annotations


import sqlalchemy as sa
from alembic import op

from outbox.migrate import rebuild_messages_table, record_additive

revision = "0013_cancelled_reason"
down_revision = "0011_observability"
branch_labels = None
depends_on = None

_OLD_REASONS = ("'expired', 'conflict', 'signature_rejected', 'gone', 'rejected', 'invalid', 'blocked', "
                "'proof_failed'")


def _reason_check(reasons: str) -> str:
    return f"dead_reason IS NULL OR dead_reason IN ({reasons})"


def _widen(reasons: str) -> None:
    with rebuild_messages_table() as batch:
        batch.drop_constraint("outbox_messages_dead_reason_check", type_="check")
        batch.create_check_constraint("outbox_messages_dead_reason_check", sa.text(_reason_check(reasons)))


def upgrade() -> None:
    _widen(_OLD_REASONS + ", 'cancelled'")
    record_additive(revision, down_revision)


def downgrade() -> None:
    op.execute(sa.text("DELETE FROM outbox_schema_compat WHERE revision = :r").bindparams(r=revision))
    op.execute(sa.text("UPDATE outbox_messages SET dead_reason = 'gone' WHERE dead_reason = 'cancelled'"))
    _widen(_OLD_REASONS)
