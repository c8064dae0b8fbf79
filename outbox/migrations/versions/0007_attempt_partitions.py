"""PostgreSQL: attempt history partitioned by day on occurred_at, so purge drops partitions.

The existing ``outbox_attempts`` table is renamed ``outbox_attempts_before_0007`` and attached
unchanged as the partition holding everything before the next UTC midnight; daily partitions
follow from there (``outbox_ensure_attempt_partitions``, run here and by every daemon). The
partitioned table keeps the name, the columns, their defaults and the id sequence, so the
INSERTs of a daemon one release behind keep working; its primary key is ``(id, occurred_at)``
because a partitioned table's key must include the partition key; the old table's key is
rebuilt so once (a write lock on it for the time of one index build). SQLite is unchanged: its purge deletes rows.

Revision ID: 0007_attempt_partitions
Revises: 0005_subscribers
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrate import record_min_reader
from outbox.partitions import AHEAD_DAYS, ENSURE_FUNCTION
from outbox.schema import schema_compat

revision = "0007_attempt_partitions"
down_revision = "0005_subscribers"
branch_labels = None
depends_on = None

_OLD = "outbox_attempts_before_0007"
_INDEXES = ("CREATE INDEX outbox_attempts_message_idx ON outbox_attempts (message_id, attempt_number)",
            "CREATE INDEX outbox_attempts_occurred_idx ON outbox_attempts (occurred_at)")


def upgrade() -> None:
    # Additive for old readers: same table name, columns, defaults and INSERTs.
    record_min_reader(revision, down_revision)
    if op.get_bind().dialect.name != "postgresql":
        return
    for statement in (
        f"ALTER TABLE outbox_attempts RENAME TO {_OLD}",
        # the partition's key must be the parent's: (id) becomes (id, occurred_at)
        f"ALTER TABLE {_OLD} DROP CONSTRAINT outbox_attempts_pkey, "
        f"ADD CONSTRAINT {_OLD}_pkey PRIMARY KEY (id, occurred_at)",
        f"ALTER INDEX outbox_attempts_message_idx RENAME TO {_OLD}_message_idx",
        f"ALTER INDEX outbox_attempts_occurred_idx RENAME TO {_OLD}_occurred_idx",
        f"CREATE TABLE outbox_attempts (LIKE {_OLD} INCLUDING DEFAULTS) PARTITION BY RANGE (occurred_at)",
        "ALTER TABLE outbox_attempts ADD CONSTRAINT outbox_attempts_pkey PRIMARY KEY (id, occurred_at)",
        *_INDEXES,
        "ALTER SEQUENCE outbox_attempts_id_seq OWNED BY outbox_attempts.id",
        f"ALTER TABLE outbox_attempts ATTACH PARTITION {_OLD} FOR VALUES FROM (MINVALUE) "
        "TO ((floor(extract(epoch from now()) / 86400) + 1) * 86400)",
        ENSURE_FUNCTION,
        f"SELECT outbox_ensure_attempt_partitions({AHEAD_DAYS})",
    ):
        op.execute(statement)


def downgrade() -> None:
    op.execute(sa.delete(schema_compat).where(schema_compat.c.revision == revision))
    if op.get_bind().dialect.name != "postgresql":
        return
    for statement in (
        "CREATE TABLE outbox_attempts_plain (LIKE outbox_attempts INCLUDING DEFAULTS)",
        "INSERT INTO outbox_attempts_plain SELECT * FROM outbox_attempts",
        "ALTER SEQUENCE outbox_attempts_id_seq OWNED BY outbox_attempts_plain.id",
        "DROP TABLE outbox_attempts",
        "DROP FUNCTION outbox_ensure_attempt_partitions(integer)",
        "ALTER TABLE outbox_attempts_plain RENAME TO outbox_attempts",
        "ALTER TABLE outbox_attempts ADD CONSTRAINT outbox_attempts_pkey PRIMARY KEY (id)",
        *_INDEXES,
    ):
        op.execute(statement)
