"""The CLI's rough edges, each pinned: one-line refusals, consistent JSON, exit statuses,
configuration that explains itself. Against real PostgreSQL and SQLite where a database is read.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from sqlalchemy import text

from outbox.config import Settings, effective
from outbox.schema import DEAD_REASONS, breakers
from supervisor.cli import build_parser, main
from tests import procs
from tests.cli_calls import cli, dead_with_an_attempt, one_line, url_of
from tests.ledger import THROWAWAY_KEY, enqueue_many

ROOT = Path(__file__).resolve().parent.parent
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def test_attempts_is_a_number_and_the_trail_a_list_times_are_rfc3339(engine, capsys, monkeypatch):
    dead_with_an_attempt(engine)
    url = url_of(engine)
    [listed] = json.loads(cli(capsys, monkeypatch, url, "list", "--json")[1])
    shown = json.loads(cli(capsys, monkeypatch, url, "show", "1", "--json")[1])
    assert listed["attempts"] == shown["attempts"] == 1
    assert [a["http_status"] for a in shown["attempt_trail"]] == [410]
    for data in (listed, shown, shown["attempt_trail"][0]):
        times = {k: v for k, v in data.items() if k.endswith(("_at", "_until")) and v is not None}
        assert times and all(RFC3339.match(v) for v in times.values()), times
    assert shown["created_at"] == listed["created_at"] and shown["finished_at"] == "1970-01-01T00:00:01.000Z"
    assert "?" not in shown["url"]
    code, out, _ = cli(capsys, monkeypatch, url, "show", "1")
    assert code == 0 and re.search(r"^attempts +1$", out, re.M)
    assert "'attempt_number'" not in out and "1970-01-01T00:00:02.000Z" in out


def test_breakers_json_times_are_rfc3339(sqlite_engine, capsys, monkeypatch):
    with sqlite_engine.begin() as conn:
        conn.execute(breakers.insert().values(tenant_id="t", origin="https://b.example", state="open", failures=5,
                                              successes=0, trips=1, open_until=60.0, updated_at=0.5))
    [row] = json.loads(cli(capsys, monkeypatch, url_of(sqlite_engine), "breakers", "list", "--json")[1])
    assert (row["open_until"], row["updated_at"]) == ("1970-01-01T00:01:00.000Z", "1970-01-01T00:00:00.500Z")


@pytest.mark.parametrize("args", [
    ["purge", "--older-than", "1d", "--batch", "0"],
    ["purge", "--older-than", "1d", "--batch", "-5"],
    ["list", "--limit", "-1"],
    ["list", "--limit", "0"],
    ["status", "--top", "-1"],
    ["list", "--reason", "bogus"],
    ["replay", "abc"],
    ["replay", "-3"],
])
def test_bad_numbers_and_reasons_are_refused_by_the_parser_in_one_line(args, capsys, monkeypatch, tmp_path):
    code, _, err = cli(capsys, monkeypatch, f"sqlite:///{tmp_path / 'never-created.db'}", *args)
    assert code == 2 and one_line(err) and err.startswith(f"outboxd {args[0]}: argument ")
    assert not (tmp_path / "never-created.db").exists()  # refused before touching any database


def test_reason_choices_are_the_schemas_dead_reasons():
    subcommands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in ("list", "replay"):
        [reason] = [a for a in subcommands[name]._actions if a.dest == "reason"]
        assert tuple(reason.choices) == DEAD_REASONS


def test_replay_exit_status_and_more_matched(engine, capsys, monkeypatch):
    dead_with_an_attempt(engine, n=3)
    url = url_of(engine)
    code, out, _ = cli(capsys, monkeypatch, url, "replay", "99")
    assert code == 1 and "not found: 99" in out
    code, out, _ = cli(capsys, monkeypatch, url, "replay", "--reason", "gone", "--limit", "2")
    assert code == 1 and "replayed 2 message(s): 1, 2" in out and "1 more matched" in out
    code, out, _ = cli(capsys, monkeypatch, url, "replay", "1", "2")  # now pending again: all refused
    assert code == 1 and out.count("refused") == 2
    code, out, _ = cli(capsys, monkeypatch, url, "replay", "3", "--json")
    assert code == 0 and json.loads(out) == {"dry_run": False, "replayed": [3], "refused": [], "missing": [],
                                             "more_matched": 0}


def test_a_key_two_tenants_use_replays_only_with_the_tenant_and_long_digit_keys_are_keys(engine, capsys,
                                                                                         monkeypatch):
    dead_with_an_attempt(engine, n=2)
    digits = "12345678901234567890"  # a snowflake-style key, past BIGINT as a number
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox_messages SET tenant_id = 'tenant-1' WHERE id = 2"))
        conn.execute(text("UPDATE outbox_messages SET idempotency_key = :k"), {"k": digits})
    url = url_of(engine)
    code, out, err = cli(capsys, monkeypatch, url, "replay", "--key", digits)
    assert code == 1 and one_line(err) and "2 tenants use the idempotency key" in err and "replayed" not in out
    code, out, _ = cli(capsys, monkeypatch, url, "replay", "--key", digits, "--tenant", "tenant-1")
    assert code == 0 and "replayed 1 message(s): 2" in out
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox_messages SET idempotency_key = 'other' WHERE id = 2"))
    code, out, _ = cli(capsys, monkeypatch, url, "show", digits, "--json")
    assert code == 0 and json.loads(out)["id"] == 1


def test_origin_selects_one_endpoint_where_a_url_substring_takes_its_neighbours(engine, capsys, monkeypatch):
    enqueue_many(engine, "http://127.0.0.1:2808", ["/a"])
    enqueue_many(engine, "http://127.0.0.1:28081", ["/b"])
    url = url_of(engine)
    code, out, _ = cli(capsys, monkeypatch, url, "list", "--url", "127.0.0.1:2808", "--json")
    assert [m["id"] for m in json.loads(out)] == [1, 2]
    code, out, _ = cli(capsys, monkeypatch, url, "list", "--origin", "http://127.0.0.1:2808/x", "--json")
    assert code == 0 and [m["id"] for m in json.loads(out)] == [1]


def test_a_breaker_of_a_tenant_with_an_at_sign_is_reset_by_the_key_list_prints(engine, capsys, monkeypatch):
    with engine.begin() as conn:
        conn.execute(breakers.insert().values(tenant_id="ops@acme.example", origin="http://127.0.0.1:9",
                                              state="open", failures=10, successes=0, trips=1, open_until=9e9,
                                              updated_at=1.0))
    url = url_of(engine)
    code, out, _ = cli(capsys, monkeypatch, url, "breakers", "list")
    assert code == 0 and "ops@acme.example@http://127.0.0.1:9" in out
    code, out, err = cli(capsys, monkeypatch, url, "breakers", "reset", "ops@acme.example@http://127.0.0.1:9")
    assert code == 0, err
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox_breakers")).scalar_one() == 0


@pytest.mark.parametrize("args", [("replay", "99999999999999999999"), ("show", "99999999999999999999"),
                                  ("status", "--top", "99999999999999999999"), ("recover", "show", "9" * 20)])
def test_a_number_past_the_databases_range_is_a_usage_error(engine, capsys, monkeypatch, args):
    code, out, err = cli(capsys, monkeypatch, url_of(engine), *args)
    assert code in (1, 2) and one_line(err) and "Traceback" not in err, err
    assert code == 2 or "no message with id or idempotency key" in err


def test_migrate_refuses_a_target_that_is_not_ahead_in_one_line(engine, capsys, monkeypatch):
    url = url_of(engine)
    for revision, words in (("", "not a revision of this release"), ("head+1", "not a revision of this release"),
                            ("0013_cancelled_reason", "older than the database's")):
        code, out, err = cli(capsys, monkeypatch, url, "migrate", "--revision", revision)
        assert code == 1 and one_line(err) and words in err and out == "", (revision, err)


def test_migrate_bad_revision_and_a_newer_database(sqlite_engine, tmp_path, capsys, monkeypatch):
    url = url_of(sqlite_engine)
    code, _, err = cli(capsys, monkeypatch, url, "migrate", "--revision", "bogus")
    assert code == 1 and one_line(err) and "bogus" in err
    with sqlite_engine.begin() as conn:
        conn.execute(text("UPDATE outbox_alembic_version SET version_num = '9999_from_the_future'"))
    code, out, _ = cli(capsys, monkeypatch, url, "migrate")
    assert code == 0 and "9999_from_the_future, newer than this release" in out
    key, _ = procs.make_key(tmp_path)
    run = subprocess.run([sys.executable, "-m", "supervisor.cli", "run"], capture_output=True, text=True, timeout=60,
                         env={**procs.daemon_env(url, key), "PYTHONPATH": str(ROOT)})
    assert run.returncode == 1 and one_line(run.stderr)
    assert "database schema is at 9999_from_the_future, newer than this outboxd" in run.stderr


@pytest.mark.parametrize("entry, fragment", [
    ('acme = { file = "k.pem" }', "needs key_id"),
    ('acme = "k.pem"', "must be a table"),
    ('acme = { file = "k.pem", key_id = 7 }', "needs key_id"),
    ('acme = { file = "k.pem", key_id = "a", kid = "b" }', "unknown key 'kid'"),
])
def test_bad_tenant_signing_key_entries_are_one_line(entry, fragment, tmp_path, capsys, monkeypatch):
    config = tmp_path / "outbox.toml"
    config.write_text(f"[outbox.tenant_signing_keys]\n{entry}\n")
    code, _, err = cli(capsys, monkeypatch, None, "--config", str(config), "config")
    assert code == 1 and one_line(err) and fragment in err and "'acme'" in err


def test_misspelt_variable_is_warned_and_toml_typo_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OUTBOX_CONCURENCY", "3")
    code, out, err = cli(capsys, monkeypatch, f"sqlite:///{tmp_path / 'x.db'}", "config")
    assert code == 0 and "concurrency = 64" in out
    assert err == ("outboxd: warning: OUTBOX_CONCURENCY is not an outboxd setting and is ignored; "
                   "did you mean OUTBOX_CONCURRENCY?\n")
    config = tmp_path / "outbox.toml"
    config.write_text("[outbox]\nconcurency = 3\n")
    code, _, err = cli(capsys, monkeypatch, None, "--config", str(config), "config")
    assert code == 1 and "unknown setting 'concurency'" in err


def test_version_matches_the_project(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert exit_.value.code == 0 and capsys.readouterr().out == f"outboxd {project}\n"


def test_config_prints_the_effective_settings_with_secrets_masked(tmp_path, capsys, monkeypatch):
    key = THROWAWAY_KEY
    monkeypatch.setenv("OUTBOX_ENCRYPTION_KEY", key)
    monkeypatch.setenv("OUTBOX_UI_TOKEN", "ui-token-SENTINEL")
    monkeypatch.setenv("OUTBOX_CONCURRENCY", "7")
    url = "postgresql+psycopg://outbox:db-password-SENTINEL@db.example/outbox"
    code, out, _ = cli(capsys, monkeypatch, url, "config")
    assert code == 0 and "SENTINEL" not in out and key not in out
    data = tomllib.loads(out)["outbox"]  # the output is itself a valid config file
    assert data["concurrency"] == 7 and data["database_url"] == "postgresql+psycopg://outbox:***@db.example/outbox"
    assert data["encryption_key"] == data["ui_token"] == "****"
    code, out, _ = cli(capsys, monkeypatch, url, "config", "--json")
    assert json.loads(out)["concurrency"] == 7 and "SENTINEL" not in out


def _documented_config_rows() -> dict[str, str]:
    page = (ROOT / "docs" / "configuration.md").read_text()
    section = page[page.index("## Settings"):]
    section = section[:section.index("\n## ", 1)]
    rows = re.findall(r"^\| `(OUTBOX_[A-Z_]+|\[outbox\.tenant_signing_keys\])` \| (.*?) \|", section, re.M)
    return dict(rows)


def test_configuration_table_lists_every_setting_with_its_default():
    rows = _documented_config_rows()
    expected = {}
    for name, value in effective(Settings()).items():
        variable = "[outbox.tenant_signing_keys]" if name == "tenant_signing_keys" else f"OUTBOX_{name.upper()}"
        expected[variable] = "–" if value in (None, {}) else f"`{json.dumps(value)}`"
    assert rows == expected
