from sqlalchemy import inspect, text

from outbox.db import make_engine
from outbox.migrate import current_revision, head_revision, upgrade
from tests.tables import EMPTIED_TABLES, KEPT_TABLES


def test_migrate_creates_prefixed_tables_on_both(engine):
    names = set(inspect(engine).get_table_names())
    assert {"outbox_messages", "outbox_attempts", "outbox_sequences", "outbox_breakers",
            "outbox_alembic_version"} <= names
    assert all(n.startswith("outbox_") for n in names)
    with engine.connect() as conn:
        assert current_revision(conn) == head_revision()


def test_every_table_is_emptied_between_tests_or_kept_on_purpose(pg_engine):
    """A table a new migration adds must join one of the two lists, or tests would see each
    other's rows in it."""
    with pg_engine.connect() as conn:
        tables = set(conn.execute(text(
            "SELECT relname FROM pg_class WHERE relnamespace = current_schema()::regnamespace"
            " AND relkind IN ('r', 'p') AND NOT relispartition")).scalars())
    assert tables == set(EMPTIED_TABLES) | set(KEPT_TABLES)


def test_migrate_is_idempotent(sqlite_url):
    before, after = upgrade(make_engine(sqlite_url))
    assert before == after == head_revision()


def test_due_index_is_partial(engine):
    indexes = {ix["name"]: ix for ix in inspect(engine).get_indexes("outbox_messages")}
    assert "outbox_messages_due_idx" in indexes
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            ddl = conn.execute(
                text("SELECT indexdef FROM pg_indexes WHERE indexname = 'outbox_messages_due_idx'")).scalar()
        else:
            ddl = conn.execute(text("SELECT sql FROM sqlite_master WHERE name = 'outbox_messages_due_idx'")).scalar()
    assert "WHERE" in ddl and "pending" in ddl


def test_beside_a_sellers_own_alembic_history(pg_engine):
    """A seller's alembic_version table is untouched by our migrations."""
    with pg_engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS alembic_version (version_num varchar(32) PRIMARY KEY)"))
        conn.execute(text("DELETE FROM alembic_version"))
        conn.execute(text("INSERT INTO alembic_version VALUES ('sellers_rev_42')"))
    upgrade(pg_engine)
    with pg_engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "sellers_rev_42"
        assert current_revision(conn) == head_revision()


def test_0005_keeps_existing_rows_and_admits_proof_failed(tmp_path):
    """The SQLite rebuild that widens the dead_reason check copies every row across."""
    engine = make_engine(f"sqlite:///{tmp_path / 'old.db'}")
    upgrade(engine, "0001")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO outbox_messages (tenant_id, url, idempotency_key, body, state, dead_reason)"
                          " VALUES ('t', 'https://b.example/h', 'whk_0123456789abcdef', x'7b7d', 'dead', 'gone')"))
    upgrade(engine)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT tenant_id, dead_reason, held FROM outbox_messages")).one() == ("t", "gone", 0)
        conn.execute(text("UPDATE outbox_messages SET dead_reason = 'proof_failed'"))
    fresh = make_engine(f"sqlite:///{tmp_path / 'new.db'}")
    upgrade(fresh)
    with engine.connect() as old, fresh.connect() as new:
        ddl = "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'outbox_messages' ORDER BY name"
        indexes = new.execute(text(ddl)).all()
        assert old.execute(text(ddl)).all() == indexes
    assert {"outbox_messages_endpoint_due_idx", "outbox_messages_held_idx"} <= {name for name, _ in indexes}


def test_schema_check_follows_the_recorded_minimum_reader(sqlite_engine):
    """docs/architecture.md, "Rolling upgrades": current, behind, ahead-but-readable, too new."""
    from outbox.migrate import check_schema, known_revisions

    def verdict(version: str, min_reader: str | None) -> str:
        with sqlite_engine.begin() as conn:
            conn.execute(text("UPDATE outbox_alembic_version SET version_num = :v"), {"v": version})
            conn.execute(text("DELETE FROM outbox_schema_compat WHERE revision = 'next'"))
            if min_reader is not None:
                conn.execute(text("INSERT INTO outbox_schema_compat VALUES ('next', :m)"), {"m": min_reader})
        with sqlite_engine.connect() as conn:
            return check_schema(conn).verdict

    older = sorted(known_revisions() - {head_revision()})[0]
    assert verdict(head_revision(), None) == "current"
    assert verdict(older, None) == "behind"
    assert verdict("next", head_revision()) == "ahead"
    assert verdict("next", older) == "ahead"
    assert verdict("next", "not-a-revision-of-ours") == "incompatible"
    assert verdict("next", None) == "incompatible"


def test_0017_refuses_ambiguous_origins_in_sql_and_its_downgrade_restores_0002s(fresh_db):
    from alembic import command

    from outbox.migrate import alembic_config

    engine = make_engine(fresh_db)
    origin = text("SELECT outbox_origin('https://buyer.example:0/h'), outbox_origin('https://127.1/h'), "
                  "outbox_origin('https://1.2.3.4:8443/h')")
    try:
        upgrade(engine)
        with engine.connect() as conn:
            assert tuple(conn.execute(origin).one()) == (None, None, "https://1.2.3.4:8443")
        with engine.begin() as conn:
            command.downgrade(alembic_config(conn), "0016_stats_failures")
        with engine.connect() as conn:
            assert tuple(conn.execute(origin).one()) == ("https://buyer.example:0", "https://127.1",
                                                         "https://1.2.3.4:8443")
    finally:
        engine.dispose()
