"""Run the shipped Alembic migrations without an ``alembic.ini``.

``outboxd migrate`` calls :func:`upgrade`; a seller that already runs Alembic can call it
from its own ``env.py`` or deploy step, or add ``outbox:migrations/versions`` to its
``version_locations`` (the branch label is ``outbox``). The separate version table keeps
the two histories independent.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Connection, Engine, inspect, select

from outbox.errors import ConfigurationError
from outbox.schema import schema_compat

VERSION_TABLE = "outbox_alembic_version"


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic ``Config`` pointing at the migrations inside this package."""
    config = Config()
    config.set_main_option("script_location", str(Path(__file__).with_name("migrations")))
    config.attributes["connection"] = connection
    return config


@lru_cache(maxsize=1)
def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    """The newest revision this release ships (the schema its code is written against)."""
    head = _script().get_current_head()
    assert head is not None
    return head


def revision_module(revision: str) -> ModuleType:
    """A shipped migration's module, loaded by Alembic (its file name is no importable module
    name): for a later migration that restores or extends what that one created."""
    return _script().get_revision(revision).module


def known_revisions() -> frozenset[str]:
    """Every revision this release ships: the head and all its ancestors."""
    return frozenset(r.revision for r in _script().walk_revisions())


def current_revision(connection: Connection) -> str | None:
    return MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE}).get_current_revision()


def _check_target(revision: str, before: str | None) -> None:
    """Refuse a target that is not one of this release's revisions, or older than the
    database's (Alembic would do nothing, and say nothing): migrations only go forward."""
    lineage = [r.revision for r in reversed(list(_script().walk_revisions()))]  # oldest first
    if revision != "head" and revision not in lineage:
        raise ConfigurationError(f"--revision {revision!r} is not a revision of this release: "
                                 f"head, or one of {lineage[0]} .. {lineage[-1]}")
    if before is not None and revision != "head" and lineage.index(revision) < lineage.index(before):
        raise ConfigurationError(f"--revision {revision!r} is older than the database's {before}: migrations only "
                                 "go forward (to go back, restore a backup taken before the upgrade)")


def upgrade(engine: Engine, revision: str = "head") -> tuple[str | None, str]:
    """Upgrade the outbox tables to ``revision``; return (revision before, revision after).

    A database already ahead of this release is left as it is (a rolling upgrade's newer
    release migrated it): ``before == after`` then. An unknown ``revision`` is a
    :class:`ConfigurationError`.
    """
    with engine.begin() as connection:
        before = current_revision(connection)
        if before is not None and before not in known_revisions():
            return before, before
        _check_target(revision, before)
        try:
            command.upgrade(alembic_config(connection), revision)
        except CommandError as exc:
            raise ConfigurationError(f"--revision {revision!r}: {exc}") from None
        return before, current_revision(connection) or ""


def record_min_reader(revision: str, min_reader_revision: str) -> None:
    """Called from a migration's ``upgrade()``: the oldest code revision that may run on it.

    The compatibility rule (docs/architecture.md, "Rolling upgrades"): migrations are
    additive, so code at ``min_reader_revision`` or later keeps working on a database at
    ``revision``. A migration that breaks older readers records its own revision.
    """
    from alembic import op
    from sqlalchemy import delete

    # A downgrade that left its row behind must not make the next upgrade fail.
    op.execute(delete(schema_compat).where(schema_compat.c.revision == revision))
    op.bulk_insert(schema_compat, [{"revision": revision, "min_reader_revision": min_reader_revision}])


def record_additive(revision: str, parent: str) -> None:
    """Called from an additive migration's ``upgrade()``: whatever code could run on ``parent``
    runs on ``revision`` too, so it inherits the parent's minimum reader (the parent itself
    where none is recorded). A release with several additive migrations then still lets the
    previous release's daemons run beside it during a rolling upgrade."""
    from alembic import op
    from sqlalchemy import select

    inherited = op.get_bind().execute(select(schema_compat.c.min_reader_revision)
                                      .where(schema_compat.c.revision == parent)).scalar()
    record_min_reader(revision, inherited or parent)


@contextmanager
def rebuild_messages_table() -> Iterator[Any]:
    """``op.batch_alter_table("outbox_messages")`` that keeps the table's indexes on SQLite.

    SQLite changes a CHECK only by rebuilding the table, and the rebuild cannot reflect
    expression indexes: their DDL is read first and each one the rebuild dropped is recreated
    exactly as it was (PostgreSQL alters in place and has nothing to restore)."""
    import warnings

    import sqlalchemy as sa
    from alembic import op

    bind = op.get_bind()
    indexes = [tuple(r) for r in bind.execute(sa.text(
        "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'outbox_messages'"
        " AND sql IS NOT NULL"))] if bind.dialect.name == "sqlite" else []
    with warnings.catch_warnings(), op.batch_alter_table("outbox_messages") as batch:
        warnings.filterwarnings("ignore", "Skipped unsupported reflection of expression-based index",
                                sa.exc.SAWarning)
        yield batch
    for name, ddl in indexes:
        found = bind.execute(sa.text("SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = :n"), {"n": name})
        if found.first() is None:
            op.execute(ddl)


@dataclass(frozen=True)
class SchemaCheck:
    """How the database's schema relates to this release's code."""

    database: str | None
    code: str
    verdict: str  # current | ahead (compatible) | behind | incompatible

    @property
    def usable(self) -> bool:
        return self.verdict in ("current", "ahead")

    def problem(self) -> str | None:
        """One line for ``/readyz`` and the log, or ``None`` when the daemon may run."""
        if self.verdict == "behind":
            return (f"database schema is at {self.database or 'nothing'}, this outboxd needs {self.code}: "
                    "waiting for `outboxd migrate`")
        if self.verdict == "incompatible":
            return (f"database schema is at {self.database}, newer than this outboxd ({self.code}) can read: "
                    "upgrade outboxd")
        return None


def check_schema(connection: Connection) -> SchemaCheck:
    """Whether code at :func:`head_revision` may run on this database (see :func:`record_min_reader`)."""
    database, code = current_revision(connection), head_revision()
    if database == code:
        return SchemaCheck(database, code, "current")
    if database is None or database in known_revisions():
        return SchemaCheck(database, code, "behind")
    min_reader = None
    if inspect(connection).has_table(schema_compat.name):
        min_reader = connection.execute(select(schema_compat.c.min_reader_revision)
                                        .where(schema_compat.c.revision == database)).scalar()
    return SchemaCheck(database, code, "ahead" if min_reader in known_revisions() else "incompatible")
