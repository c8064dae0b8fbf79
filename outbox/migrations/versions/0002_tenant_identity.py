"""Per-tenant identity, binding digests, tenant-scoped streams, one origin function.

- ``(idempotency_key, tenant_id)`` becomes the unique identity (the key-first order keeps
  ``outboxd show KEY`` on the index); the global unique index on the key goes, since two
  tenants may now hold one key string. Producers of this release insert with a target-less
  ``ON CONFLICT DO NOTHING``, which works against either index: upgrade the library first,
  then migrate (a previous-release *producer* names the old index and fails after it).
- ``binding_digest`` (nullable): what each key is bound to. Writers that do not fill it
  (plain SQL, older releases) keep working; their rows are judged from the stored columns.
- PostgreSQL: ``outbox_origin(url)`` computes exactly what ``outbox.urls.origin`` gives
  (lowercase scheme and host, default port dropped, no userinfo) or NULL where it cannot
  (IDN hosts, IPv4-in-IPv6 literals); the insert trigger uses it for rows that leave origin
  NULL, and the daemon recomputes every claimed row's origin in Python and writes back any
  difference (a plain-SQL writer's own origin included).
  ``outbox_next_sequence(tenant, stream)`` allocates on the tenant's own stream, with the
  key ``outbox.identity.stream_key`` builds; the one-argument form stays as it was.

Revision ID: 0002_tenant_identity
Revises: 0004_keyring
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrate import record_min_reader, revision_module
from outbox.schema import schema_compat

revision = "0002_tenant_identity"
down_revision = "0004_keyring"
branch_labels = None
depends_on = None

_ORIGIN = r"""
CREATE OR REPLACE FUNCTION outbox_origin(p_url text) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    parts text[];
    scheme text;
    authority text;
    host text;
    port text;
BEGIN
    parts := regexp_match(p_url, '^([A-Za-z][A-Za-z0-9+.-]*)://([^/?#]*)');
    IF parts IS NULL THEN
        RETURN NULL;
    END IF;
    scheme := lower(parts[1]);
    authority := regexp_replace(parts[2], '^.*@', '');  -- userinfo is never part of an origin
    parts := regexp_match(authority, '^(\[[0-9A-Fa-f:]+\]|[^:]*)(?::([0-9]*))?$');
    IF parts IS NULL THEN
        RETURN NULL;
    END IF;
    IF left(parts[1], 1) = '[' THEN
        BEGIN
            host := host(btrim(parts[1], '[]')::inet);
        EXCEPTION WHEN invalid_text_representation THEN
            RETURN NULL;
        END;
        IF host LIKE '%.%' THEN
            RETURN NULL;  -- IPv4 forms inside IPv6 print differently in Python: the daemon decides
        END IF;
        host := '[' || host || ']';
    ELSE
        host := lower(parts[1]);
        IF host ~ '[^.]\.$' THEN
            host := left(host, -1);  -- one trailing dot
        END IF;
        IF host !~ '^(?:(?!-)[a-z0-9-]{1,63}(?<!-)\.)*(?!-)[a-z0-9-]{1,63}(?<!-)$'
                OR host ~ '(?:^|\.)xn--' THEN
            RETURN NULL;  -- IDN and anything unusual: the daemon computes it in Python
        END IF;
    END IF;
    port := NULLIF(parts[2], '');  -- "host:" has no port
    IF port IS NOT NULL THEN
        port := ltrim(port, '0');
        IF port = '' THEN
            port := '0';
        END IF;
        IF length(port) > 5 OR port::int > 65535 THEN
            RETURN NULL;
        END IF;
        IF port = (CASE scheme WHEN 'https' THEN '443' WHEN 'http' THEN '80' END) THEN
            port := NULL;
        END IF;
    END IF;
    RETURN scheme || '://' || host || COALESCE(':' || port, '');
END $$
"""

_FILL = """
CREATE OR REPLACE FUNCTION outbox_messages_fill() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.origin IS NULL THEN  -- the Python producer fills it; the daemon corrects any other
        NEW.origin := outbox_origin(NEW.url);
    END IF;
    IF NEW.body_sha256 IS NULL THEN
        NEW.body_sha256 := sha256(NEW.body);
    END IF;
    RETURN NEW;
END $$
"""

# The tenant's stream, keyed as outbox.identity.stream_key(tenant, stream) keys it; a stream
# continues from the counter its one-argument (pre-0002) key reached.
_NEXT_SEQUENCE = """
CREATE FUNCTION outbox_next_sequence(p_tenant_id text, p_stream_key text) RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    INSERT INTO outbox_sequences AS s (stream_key, last_value)
    VALUES (length(p_tenant_id) || ':' || p_tenant_id || length(p_stream_key) || ':' || p_stream_key,
            COALESCE((SELECT o.last_value FROM outbox_sequences AS o WHERE o.stream_key = p_stream_key), 0) + 1)
    ON CONFLICT (stream_key) DO UPDATE SET last_value = s.last_value + 1
    RETURNING s.last_value
$$
"""


def upgrade() -> None:
    op.add_column("outbox_messages", sa.Column("binding_digest", sa.LargeBinary))
    op.create_index("outbox_messages_key_tenant_key", "outbox_messages", ["idempotency_key", "tenant_id"],
                    unique=True)
    op.drop_index("outbox_messages_idempotency_key_key", table_name="outbox_messages")
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_ORIGIN)
        op.execute(_FILL)
        op.execute(_NEXT_SEQUENCE)
    # Additive for daemons: the previous release's daemon keeps running on this schema.
    record_min_reader(revision, down_revision)


def downgrade() -> None:
    op.execute(sa.delete(schema_compat).where(schema_compat.c.revision == revision))
    if op.get_bind().dialect.name == "postgresql":
        restore_0001_fill = revision_module("0001")._PG_CONTRACT[1:3]  # its fill function and trigger
        for statement in ("DROP FUNCTION outbox_next_sequence(text, text)", "DROP TRIGGER outbox_messages_fill"
                          " ON outbox_messages", "DROP FUNCTION outbox_messages_fill()", *restore_0001_fill,
                          "DROP FUNCTION outbox_origin(text)"):
            op.execute(statement)
    # Fails when two tenants already share a key string: that data has no pre-0002 form.
    op.create_index("outbox_messages_idempotency_key_key", "outbox_messages", ["idempotency_key"], unique=True)
    op.drop_index("outbox_messages_key_tenant_key", table_name="outbox_messages")
    with op.batch_alter_table("outbox_messages") as batch:
        batch.drop_column("binding_digest")
