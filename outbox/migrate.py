"""Run the shipped Alembic migrations without an ``alembic.ini``.

``outboxd migrate`` calls :func:`upgrade`; a seller that already runs Alembic can call it
from its own ``env.py`` or deploy step, or add ``outbox:migrations/versions`` to its
``version_locations`` (the branch label is ``outbox``). The separate version table keeps
the two histories independent.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine

VERSION_TABLE = "outbox_alembic_version"


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic ``Config`` pointing at the migrations inside this package."""
    config = Config()
    config.set_main_option("script_location", str(Path(__file__).with_name("migrations")))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(connection: Connection) -> str | None:
    return MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE}).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> tuple[str | None, str]:
    """Upgrade the outbox tables to ``revision``; return (revision before, revision after)."""
    with engine.begin() as connection:
        before = current_revision(connection)
        command.upgrade(alembic_config(connection), revision)
        return before, current_revision(connection) or ""


def is_current(connection: Connection) -> bool:
    """Whether the database is at the head revision (the ``/readyz`` check)."""
    return current_revision(connection) == head_revision()
