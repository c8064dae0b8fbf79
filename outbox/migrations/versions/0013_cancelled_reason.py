"""The ``cancelled`` dead reason: a pending message whose subscriber was revoked.

Revision ID: 0013_cancelled_reason
Revises: 0011_observability

Additive (a wider ``dead_reason`` check): a daemon one release behind keeps delivering and
never writes the new reason itself.
"""

from __future__ import annotations

import warnings

import sqlalchemy as sa
from alembic import op

from outbox.migrate import record_additive

revision = "0013_cancelled_reason"
down_revision = "0011_observability"
branch_labels = None
depends_on = None

_OLD_REASONS = ("'expired', 'conflict', 'signature_rejected', 'gone', 'rejected', 'invalid', 'blocked', "
                "'proof_failed'")


def _reason_check(reasons: str) -> str:
    return f"dead_reason IS NULL OR dead_reason IN ({reasons})"


def _widen(reasons: str) -> None:
    dialect = op.get_bind().dialect.name
    indexes = [tuple(r) for r in op.get_bind().execute(sa.text(
        "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'outbox_messages'"
        " AND sql IS NOT NULL"))] if dialect == "sqlite" else []
    with warnings.catch_warnings(), op.batch_alter_table("outbox_messages") as batch:  # SQLite: a CHECK changes only by a rebuild
        # The rebuild cannot reflect the expression indexes; the loop below recreates them.
        warnings.filterwarnings("ignore", "Skipped unsupported reflection of expression-based index",
                                sa.exc.SAWarning)
        batch.drop_constraint("outbox_messages_dead_reason_check", type_="check")
        batch.create_check_constraint("outbox_messages_dead_reason_check", sa.text(_reason_check(reasons)))
    for name, ddl in indexes:  # the rebuild cannot reflect expression indexes: recreate them as they were
        found = op.get_bind().execute(sa.text("SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = :n"),
                                      {"n": name})
        if found.first() is None:
            op.execute(ddl)


def upgrade() -> None:
    _widen(_OLD_REASONS + ", 'cancelled'")
    record_additive(revision, down_revision)


def downgrade() -> None:
    op.execute(sa.text("DELETE FROM outbox_schema_compat WHERE revision = :r").bindparams(r=revision))
    op.execute(sa.text("UPDATE outbox_messages SET dead_reason = 'gone' WHERE dead_reason = 'cancelled'"))
    _widen(_OLD_REASONS)
