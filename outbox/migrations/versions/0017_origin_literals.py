"""``outbox_origin(url)`` (PostgreSQL) returns NULL, as ``outbox.urls.endpoint_origin`` gives
``None``, for the destinations a URL names only ambiguously: port 0, and a host ending in a
number that is not a dotted quad (``127.1``, ``2130706433``, ``0x7f000001``, ``0177.0.0.1``,
which resolvers read as IPv4 addresses). The plain-SQL row keeps an origin only where the
daemon computes the same one (docs/enqueue.md "URL rules"); the daemon ends such a row
``dead`` (``invalid``) at its claim, whichever release wrote it.

Additive: the function is replaced in place, and nothing else reads it.

Revision ID: 0017_origin_literals
Revises: 0016_stats_failures
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrate import record_additive, revision_module
from outbox.schema import schema_compat

revision = "0017_origin_literals"
down_revision = "0016_stats_failures"
branch_labels = None
depends_on = None

# Inserted into 0002's function where it has the lowercased host name and the port.
_NUMERIC_HOST = r"""
        IF host ~ '(?:^|\.)(?:[0-9]+|0x[0-9a-f]*)$' AND host !~
                '^((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])$'
                THEN
            RETURN NULL;  -- an IPv4 address in a non-standard form: Python refuses it
        END IF;
    END IF;
    port := NULLIF(parts[2], '');"""
_ZERO_PORT = """
        IF port = '0' OR length(port) > 5 OR port::int > 65535 THEN"""


def _origin_function() -> str:
    """0002's ``outbox_origin`` with the two cases above returning NULL."""
    before = revision_module("0002_tenant_identity")._ORIGIN
    edits = (("\n    END IF;\n    port := NULLIF(parts[2], '');", _NUMERIC_HOST),
             ("\n        IF length(port) > 5 OR port::int > 65535 THEN", _ZERO_PORT))
    after = before
    for old, new in edits:
        assert after.count(old) == 1, old
        after = after.replace(old, new)
    return after


def upgrade() -> None:
    record_additive(revision, down_revision)
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_origin_function())


def downgrade() -> None:
    op.execute(sa.delete(schema_compat).where(schema_compat.c.revision == revision))
    if op.get_bind().dialect.name == "postgresql":
        op.execute(revision_module("0002_tenant_identity")._ORIGIN)
