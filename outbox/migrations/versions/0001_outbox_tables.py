"""Outbox tables, partial claim indexes, and the PostgreSQL SQL-producer contract.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.schema import PG_NOW, SQLITE_NOW

revision = "0001"
down_revision = None
branch_labels = ("outbox",)
depends_on = None

_Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_Epoch = sa.Float(53)

# What a producer in any language gets from PostgreSQL: the next number of a stream in
# its own transaction (row lock held to commit: gapless, commit-ordered), origin and body
# hash filled in, and one wake-up NOTIFY per transaction (identical notifications in one
# transaction are folded into one by PostgreSQL).
_PG_CONTRACT = [
    """
    CREATE FUNCTION outbox_next_sequence(p_stream_key text) RETURNS bigint
    LANGUAGE sql VOLATILE AS $$
        INSERT INTO outbox_sequences AS s (stream_key, last_value) VALUES (p_stream_key, 1)
        ON CONFLICT (stream_key) DO UPDATE SET last_value = s.last_value + 1
        RETURNING s.last_value
    $$
    """,
    """
    CREATE FUNCTION outbox_messages_fill() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF NEW.origin IS NULL THEN
            NEW.origin := lower(substring(NEW.url from '^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*'));
        END IF;
        IF NEW.body_sha256 IS NULL THEN
            NEW.body_sha256 := sha256(NEW.body);
        END IF;
        RETURN NEW;
    END $$
    """,
    """
    CREATE TRIGGER outbox_messages_fill BEFORE INSERT ON outbox_messages
    FOR EACH ROW EXECUTE FUNCTION outbox_messages_fill()
    """,
    """
    CREATE FUNCTION outbox_messages_notify() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_notify('outbox_wakeup', '');
        RETURN NULL;
    END $$
    """,
    """
    CREATE TRIGGER outbox_messages_notify AFTER INSERT ON outbox_messages
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_messages_notify()
    """,
    # The hot table is updated on every claim and completion: vacuum it early and often
    # (docs/architecture.md, "The message state machine").
    """
    ALTER TABLE outbox_messages SET (autovacuum_vacuum_scale_factor = 0.01,
        autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_cost_delay = 1)
    """,
]


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    now = sa.text(f"({PG_NOW})" if dialect == "postgresql" else f"({SQLITE_NOW})")
    pending = sa.text("state = 'pending'")
    in_flight = sa.text("state = 'in_flight'")
    finished = sa.text("finished_at IS NOT NULL")

    op.create_table(
        "outbox_messages",
        sa.Column("id", _Id, primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("origin", sa.Text),
        sa.Column("idempotency_key", sa.Text, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("body_sha256", sa.LargeBinary),
        sa.Column("auth_mode", sa.Text, nullable=False, server_default="rfc9421"),
        sa.Column("auth_secret", sa.LargeBinary),
        sa.Column("task_id", sa.Text),
        sa.Column("task_type", sa.Text),
        sa.Column("task_status", sa.Text),
        sa.Column("notification_type", sa.Text),
        sa.Column("operation_id", sa.Text),
        sa.Column("sequence_key", sa.Text),
        sa.Column("sequence_number", sa.BigInteger),
        sa.Column("state", sa.Text, nullable=False, server_default="pending"),
        sa.Column("dead_reason", sa.Text),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("horizon_seconds", sa.Integer),
        sa.Column("trigger", sa.Text, nullable=False, server_default="scheduled"),
        sa.Column("created_at", _Epoch, nullable=False, server_default=now),
        sa.Column("next_attempt_at", _Epoch, nullable=False, server_default=now),
        sa.Column("first_attempt_at", _Epoch),
        sa.Column("retry_until", _Epoch),
        sa.Column("lease_token", sa.Text),
        sa.Column("lease_expires_at", _Epoch),
        sa.Column("leased_by", sa.Text),
        sa.Column("last_status", sa.Integer),
        sa.Column("last_error", sa.Text),
        sa.Column("finished_at", _Epoch),
        sa.CheckConstraint("state IN ('pending', 'in_flight', 'delivered', 'dead')",
                           name="outbox_messages_state_check"),
        sa.CheckConstraint(
            "dead_reason IS NULL OR dead_reason IN ('expired', 'conflict', 'signature_rejected', 'gone', "
            "'rejected', 'invalid', 'blocked')",
            name="outbox_messages_dead_reason_check",
        ),
        sa.CheckConstraint("auth_mode IN ('rfc9421', 'hmac', 'bearer')", name="outbox_messages_auth_mode_check"),
        sa.CheckConstraint("trigger IN ('scheduled', 'replay')", name="outbox_messages_trigger_check"),
        sa.CheckConstraint("(state = 'dead') = (dead_reason IS NOT NULL)", name="outbox_messages_dead_has_reason"),
        sa.CheckConstraint(
            "horizon_seconds IS NULL OR horizon_seconds BETWEEN 86400 AND 604800", name="outbox_messages_horizon_check"
        ),
    )
    op.create_index("outbox_messages_idempotency_key_key", "outbox_messages", ["idempotency_key"], unique=True)
    op.create_index("outbox_messages_due_idx", "outbox_messages", ["next_attempt_at", "id"],
                    postgresql_where=pending, sqlite_where=pending)
    op.create_index("outbox_messages_lease_idx", "outbox_messages", ["lease_expires_at"],
                    postgresql_where=in_flight, sqlite_where=in_flight)
    op.create_index("outbox_messages_finished_idx", "outbox_messages", ["finished_at"],
                    postgresql_where=finished, sqlite_where=finished)
    op.create_index("outbox_messages_tenant_idx", "outbox_messages", ["tenant_id", "created_at"])

    op.create_table(
        "outbox_attempts",
        sa.Column("id", _Id, primary_key=True, autoincrement=True),
        sa.Column("message_id", sa.BigInteger, nullable=False),
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("attempt_number", sa.Integer, nullable=False),
        sa.Column("outcome", sa.Text, nullable=False),
        sa.Column("http_status", sa.Integer),
        sa.Column("error", sa.Text),
        sa.Column("response_time_ms", sa.Integer),
        sa.Column("will_retry", sa.Boolean, nullable=False),
        sa.Column("next_retry_at", _Epoch),
        sa.Column("payload_size", sa.Integer),
        sa.Column("sequence_number", sa.BigInteger),
        sa.Column("idempotency_key", sa.Text, nullable=False),
        sa.Column("notification_type", sa.Text),
        sa.Column("trigger", sa.Text, nullable=False),
        sa.Column("daemon_id", sa.Text),
        sa.Column("occurred_at", _Epoch, nullable=False, server_default=now),
    )
    op.create_index("outbox_attempts_message_idx", "outbox_attempts", ["message_id", "attempt_number"])
    op.create_index("outbox_attempts_occurred_idx", "outbox_attempts", ["occurred_at"])

    op.create_table(
        "outbox_sequences",
        sa.Column("stream_key", sa.Text, primary_key=True),
        sa.Column("last_value", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "outbox_breakers",
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("origin", sa.Text, nullable=False),
        sa.Column("state", sa.Text, nullable=False, server_default="closed"),
        sa.Column("failures", sa.Integer, nullable=False, server_default="0"),
        sa.Column("successes", sa.Integer, nullable=False, server_default="0"),
        sa.Column("trips", sa.Integer, nullable=False, server_default="0"),
        sa.Column("open_until", _Epoch),
        sa.Column("probe_until", _Epoch),
        sa.Column("updated_at", _Epoch, nullable=False, server_default=now),
        sa.PrimaryKeyConstraint("tenant_id", "origin", name="outbox_breakers_pkey"),
        sa.CheckConstraint("state IN ('closed', 'open', 'half_open')", name="outbox_breakers_state_check"),
    )
    if dialect == "postgresql":
        for statement in _PG_CONTRACT:
            op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS outbox_messages_notify ON outbox_messages")
        op.execute("DROP TRIGGER IF EXISTS outbox_messages_fill ON outbox_messages")
        op.execute("DROP FUNCTION IF EXISTS outbox_messages_notify()")
        op.execute("DROP FUNCTION IF EXISTS outbox_messages_fill()")
        op.execute("DROP FUNCTION IF EXISTS outbox_next_sequence(text)")
    for table in ("outbox_breakers", "outbox_sequences", "outbox_attempts", "outbox_messages"):
        op.drop_table(table)
