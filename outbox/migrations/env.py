"""Alembic environment: runs on the connection handed over by :mod:`outbox.migrate`."""

from __future__ import annotations

from alembic import context

from outbox.migrate import VERSION_TABLE
from outbox.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:  # invoked through the plain `alembic` CLI with -x url=...
    from outbox.db import make_engine

    url = context.get_x_argument(as_dictionary=True).get("url") or context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("no database to migrate: pass -x url=postgresql+psycopg://... (or run `outboxd migrate`)")
    connection = make_engine(url).connect()

context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table=VERSION_TABLE,
    render_as_batch=connection.dialect.name == "sqlite",
    transactional_ddl=True,
)
with context.begin_transaction():
    context.run_migrations()
