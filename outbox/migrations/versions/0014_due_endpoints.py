"""PostgreSQL: the endpoints and origins with due work, so the claim's cost does not grow with
how many endpoints have a backlog (docs/architecture.md, "Claiming ahead").

- ``outbox_due_origins`` (origin, due) and ``outbox_due_endpoints`` (tenant, origin, due):
  a lower bound of the earliest ``next_attempt_at`` of the pending messages of each origin
  and endpoint. The claim reads them in due order and writes back what it found
  (outbox/claim_sql.py, ``claim_sql``).
- ``outbox_due_arrivals``: an append-only log of "this endpoint may be due at this time",
  written by a row trigger whenever a message becomes pending (insert, retry, release,
  rescue, replay) or comes due earlier, and when a breaker closes or is reset. Producers only
  append to it, so no seller transaction ever waits on another's lock; the daemon folds it
  into the two tables before each claim.

Additive: producers and daemons of the previous release keep working (the trigger covers
every writer). SQLite is unchanged: its claim ranks the due rows directly.

Revision ID: 0014_due_endpoints
Revises: 0013_cancelled_reason
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrate import record_additive
from outbox.schema import schema_compat

revision = "0014_due_endpoints"
down_revision = "0013_cancelled_reason"
branch_labels = None
depends_on = None

_UPGRADE = (
    """CREATE TABLE outbox_due_origins (
        origin text PRIMARY KEY,
        due float8 NOT NULL)""",
    "CREATE INDEX outbox_due_origins_due_idx ON outbox_due_origins (due)",
    """CREATE TABLE outbox_due_endpoints (
        origin text NOT NULL,
        tenant_id text NOT NULL,
        due float8 NOT NULL,
        PRIMARY KEY (origin, tenant_id))""",
    "CREATE INDEX outbox_due_endpoints_due_idx ON outbox_due_endpoints (origin, due)",
    # No index, no key: appending is all a producer pays; the daemon reads it whole.
    "CREATE TABLE outbox_due_arrivals (tenant_id text NOT NULL, origin text NOT NULL, due float8 NOT NULL)",
    """CREATE FUNCTION outbox_messages_queue() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO outbox_due_arrivals (tenant_id, origin, due)
        VALUES (NEW.tenant_id, COALESCE(NEW.origin, ''), NEW.next_attempt_at);
        RETURN NEW;
    END $$""",
    # BEFORE triggers run in name order: this one after outbox_messages_fill set the origin.
    """CREATE TRIGGER outbox_messages_queue_insert BEFORE INSERT ON outbox_messages
    FOR EACH ROW WHEN (NEW.state = 'pending') EXECUTE FUNCTION outbox_messages_queue()""",
    # Only a change that can make an endpoint due earlier than it was: claims and deliveries
    # (in_flight, delivered, dead) never call the function.
    """CREATE TRIGGER outbox_messages_queue_update BEFORE UPDATE ON outbox_messages
    FOR EACH ROW WHEN (NEW.state = 'pending' AND (OLD.state <> 'pending'
        OR NEW.next_attempt_at < OLD.next_attempt_at OR NEW.tenant_id <> OLD.tenant_id
        OR NEW.origin IS DISTINCT FROM OLD.origin))
    EXECUTE FUNCTION outbox_messages_queue()""",
    # A breaker that closes, is reset, or whose open period or probe lease is cut short frees
    # an endpoint the claim had put off until that period's end: look at it again now.
    """CREATE FUNCTION outbox_breakers_queue() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO outbox_due_arrivals (tenant_id, origin, due) VALUES (OLD.tenant_id, OLD.origin, 0);
        RETURN NULL;
    END $$""",
    """CREATE TRIGGER outbox_breakers_queue_update AFTER UPDATE ON outbox_breakers
    FOR EACH ROW WHEN ((NEW.state = 'closed' AND OLD.state <> 'closed') OR NEW.open_until < OLD.open_until
        OR NEW.probe_until < OLD.probe_until)
    EXECUTE FUNCTION outbox_breakers_queue()""",
    """CREATE TRIGGER outbox_breakers_queue_delete AFTER DELETE ON outbox_breakers
    FOR EACH ROW WHEN (OLD.state <> 'closed') EXECUTE FUNCTION outbox_breakers_queue()""",
    # What is pending already (the triggers exist from here on, in this same transaction).
    """INSERT INTO outbox_due_endpoints (origin, tenant_id, due)
    SELECT COALESCE(origin, ''), tenant_id, min(next_attempt_at) FROM outbox_messages
    WHERE state = 'pending' GROUP BY 1, 2""",
    "INSERT INTO outbox_due_origins (origin, due) SELECT origin, min(due) FROM outbox_due_endpoints GROUP BY 1",
)

_DOWNGRADE = (
    "DROP TRIGGER outbox_breakers_queue_delete ON outbox_breakers",
    "DROP TRIGGER outbox_breakers_queue_update ON outbox_breakers",
    "DROP FUNCTION outbox_breakers_queue()",
    "DROP TRIGGER outbox_messages_queue_update ON outbox_messages",
    "DROP TRIGGER outbox_messages_queue_insert ON outbox_messages",
    "DROP FUNCTION outbox_messages_queue()",
    "DROP TABLE outbox_due_arrivals",
    "DROP TABLE outbox_due_endpoints",
    "DROP TABLE outbox_due_origins",
)


def upgrade() -> None:
    # Additive for old readers: nothing they read or write changes.
    record_additive(revision, down_revision)
    if op.get_bind().dialect.name != "postgresql":
        return
    for statement in _UPGRADE:
        op.execute(statement)


def downgrade() -> None:
    op.execute(sa.delete(schema_compat).where(schema_compat.c.revision == revision))
    if op.get_bind().dialect.name != "postgresql":
        return
    for statement in _DOWNGRADE:
        op.execute(statement)
