"""The CLI where an operator first bumps into it: an unmigrated database, a pipe closed early,
a cut listing, a dry run, exit statuses, URL spellings, typos. Real SQLite files and a real
PostgreSQL database; the pipe test runs the real ``outboxd`` process.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from outbox.config import load_settings
from outbox.schema import breakers, messages
from tests.db_proxies import stalling_proxy
from tests.ledger import enqueue_many, enqueue_tasks
from tests.cli_calls import cli, dead_with_an_attempt, one_line, url_of

ROOT = Path(__file__).resolve().parent.parent
READ_COMMANDS = [["status"], ["list"], ["show", "1"], ["breakers", "list"], ["keys", "list"], ["keys", "jwks"],
                 ["encryption", "status"], ["subscribers", "list"], ["purge", "--older-than", "30d", "--dry-run"]]


@pytest.mark.parametrize("args", READ_COMMANDS, ids=" ".join)
def test_a_missing_sqlite_database_is_one_line_with_the_fix_and_never_created(args, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OUTBOX_DATABASE_URL", raising=False)  # the default: sqlite:///outbox.db, here
    code, out, err = cli(capsys, monkeypatch, None, *args)
    assert code == 1 and out == "" and one_line(err), err
    assert "outboxd migrate" in err and "outbox.db" in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("command", ["run", "ui"])
def test_the_daemon_and_the_console_refuse_a_missing_or_unmigrated_sqlite_file_at_start(command, tmp_path):
    """Neither creates an empty outbox.db to wait on or serve errors from: one line naming the
    fix, at once. (An existing but empty file is a database `run` waits for `migrate` on.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    missing = tmp_path / "outbox.db"
    done = subprocess.run([sys.executable, "-m", "supervisor.cli", command], capture_output=True, text=True,
                          cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)}, timeout=30)
    assert done.returncode == 1 and done.stdout == "" and one_line(done.stderr), done.stderr
    assert "outboxd migrate" in done.stderr and "outbox.db" in done.stderr
    assert os.listdir(tmp_path) == [], missing
    if command == "ui":
        missing.touch()
        done = subprocess.run([sys.executable, "-m", "supervisor.cli", "ui"], capture_output=True, text=True,
                              cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)}, timeout=30)
        assert done.returncode == 1 and one_line(done.stderr) and "has no outbox tables" in done.stderr, done.stderr


@pytest.mark.parametrize("args", READ_COMMANDS[:6], ids=" ".join)
def test_an_unmigrated_database_is_one_line_with_the_fix(args, fresh_db, tmp_path, capsys, monkeypatch):
    empty_sqlite = tmp_path / "empty.db"
    empty_sqlite.touch()
    for url in (fresh_db, f"sqlite:///{empty_sqlite}"):
        code, out, err = cli(capsys, monkeypatch, url, *args)
        assert code == 1 and out == "" and one_line(err), err
        assert "has no outbox tables" in err and "run `outboxd migrate`" in err
    with sqlite3.connect(empty_sqlite) as conn:  # nothing was created in it either
        assert conn.execute("SELECT name FROM sqlite_master").fetchall() == []


def test_postgres_scheme_is_accepted_as_postgresql(pg_engine, capsys, monkeypatch):
    url = url_of(pg_engine).replace("postgresql+psycopg://", "postgres://")
    assert url.startswith("postgres://")
    code, out, err = cli(capsys, monkeypatch, url, "status", "--json")
    assert code == 0, err
    assert json.loads(out)["messages"]["pending"] == 0
    assert load_settings(env={"OUTBOX_DATABASE_URL": url}).database_url.startswith("postgresql://")


def test_status_says_none_due_rather_than_zero_seconds(sqlite_engine, capsys, monkeypatch):
    code, out, _ = cli(capsys, monkeypatch, url_of(sqlite_engine), "status")
    assert code == 0 and "oldest due none (nothing pending)" in out and "0.0 s" not in out
    enqueue_many(sqlite_engine, "https://buyer.example/hook", [""])
    code, out, _ = cli(capsys, monkeypatch, url_of(sqlite_engine), "status")
    assert code == 0 and re.search(r"^oldest due \d+\.\d s$", out, re.M), out
    with sqlite_engine.begin() as conn:  # a retry's back-off: pending, but not due for an hour
        conn.execute(messages.update().values(next_attempt_at=messages.c.next_attempt_at + 3600))
    code, out, _ = cli(capsys, monkeypatch, url_of(sqlite_engine), "status")
    assert code == 0 and re.search(r"^oldest due none \(all pending in back-off, the next due in 3\d{3}\.\d s\)$",
                                   out, re.M), out


def test_status_does_not_call_an_empty_keyring_complete(sqlite_engine, capsys, monkeypatch):
    code, out, _ = cli(capsys, monkeypatch, url_of(sqlite_engine), "status")
    [line] = [line for line in out.splitlines() if line.startswith("signing")]
    assert code == 0 and "every scope has an active key" not in line and "no key yet" in line, line
    assert "OUTBOX_SIGNING_KEY_FILE" in line


def test_an_empty_jwks_is_printed_with_a_warning_not_to_publish_it(sqlite_engine, capsys, monkeypatch):
    code, out, err = cli(capsys, monkeypatch, url_of(sqlite_engine), "keys", "jwks")
    assert code == 0 and json.loads(out) == {"keys": []}
    assert one_line(err) and "no published key" in err and "OUTBOX_SIGNING_KEY_FILE" in err


def test_a_job_action_refused_for_its_state_says_the_state(sqlite_engine, capsys, monkeypatch):
    url = url_of(sqlite_engine)
    assert cli(capsys, monkeypatch, url, "recover", "start", "--tenant", "acme", "--since", "6h")[0] == 0
    assert cli(capsys, monkeypatch, url, "recover", "cancel", "1")[0] == 0
    code, _, err = cli(capsys, monkeypatch, url, "recover", "pause", "1")
    assert code == 1 and one_line(err) and "job 1 is cancelled: it cannot pause" in err, err
    code, _, err = cli(capsys, monkeypatch, url, "recover", "pause", "9")
    assert code == 1 and "no job 9" in err, err


def test_the_job_listing_says_when_it_left_older_jobs_out(sqlite_engine, capsys, monkeypatch):
    from outbox.schema import jobs
    with sqlite_engine.begin() as conn:
        conn.execute(jobs.insert(), [{"tenant_id": "acme", "state": "done", "kind": "replay", "total": 0, "since": 0.0,
                                      "until": 1.0, "force": False, "rate": 50.0, "created_at": 1.0 + i,
                                      "updated_at": 1.0 + i}
                                     for i in range(52)])
    url = url_of(sqlite_engine)
    code, out, err = cli(capsys, monkeypatch, url, "recover", "list", "--json")
    assert code == 0 and len(json.loads(out)) == 50 and json.loads(out)[0]["id"] == 52
    assert err == "showing the newest 50 of 52 jobs: raise --limit\n"
    code, out, err = cli(capsys, monkeypatch, url, "recover", "list", "--limit", "60", "--json")
    assert code == 0 and len(json.loads(out)) == 52 and err == ""


@pytest.mark.parametrize("args", [("status",), ("list",), ("show", "1"), ("breakers", "list"), ("endpoints",),
                                  ("recover", "list"), ("subscribers", "list"), ("encryption", "status"),
                                  ("replay", "--dry-run", "--state", "pending"), ("keys", "list"),
                                  ("keys", "jwks"), ("keys", "revocations")])
def test_reading_commands_neither_wait_for_nor_take_sqlites_write_lock(sqlite_engine, capsys, monkeypatch, args):
    """A seller's transaction holding the write lock does not hold up a command that only
    reads (WAL readers read a snapshot), and such a command never takes the lock itself, so
    a seller's enqueue never waits behind an operator's ``list``."""
    enqueue_many(sqlite_engine, "https://buyer.example/hook", [""])
    path = sqlite_engine.url.database
    seller = sqlite3.connect(path, isolation_level=None)
    try:
        seller.execute("BEGIN IMMEDIATE")
        seller.execute("UPDATE outbox_messages SET attempts = attempts WHERE id = 1")
        started = time.monotonic()
        code, _, err = cli(capsys, monkeypatch, url_of(sqlite_engine), *args)
        assert code in (0, 1) and "locked" not in err and time.monotonic() - started < 5, err
    finally:
        seller.execute("ROLLBACK")
        seller.close()


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
@pytest.mark.parametrize("args", [("migrate",), ("status",), ("run",)])
def test_an_in_memory_sqlite_database_is_refused_in_one_line(url, args, capsys, monkeypatch):
    """It would live and end with each process: migrate "succeeded", then every command said to
    run migrate, and the daemon waited for it for good."""
    code, out, err = cli(capsys, monkeypatch, url, *args)
    assert code == 1 and one_line(err) and "in-memory SQLite database" in err and out == "", err


def test_migrate_into_a_directory_that_does_not_exist_names_it(tmp_path, capsys, monkeypatch):
    for path, words in ((tmp_path / "nodir" / "x.db", f"no directory {tmp_path / 'nodir'} for the SQLite file"),
                        ("~/x.db", "a ~ is not expanded")):
        code, out, err = cli(capsys, monkeypatch, f"sqlite:///{path}", "migrate")
        assert code == 1 and one_line(err) and words in err and out == "", err


def test_a_replay_that_fails_part_way_says_what_it_replayed(pg_engine, capsys, monkeypatch):
    """A replay commits in chunks of 500: one failing in its second chunk has replayed the
    first, and says so (it used to raise, and the console offered the same confirmation again)."""
    from sqlalchemy import text
    enqueue_many(pg_engine, "https://buyer.example/hook", [""] * 600, per_txn=600)
    with pg_engine.begin() as conn:
        conn.execute(messages.update().values(state="dead", dead_reason="gone", finished_at=1.0, retry_until=9e9))
        conn.execute(text("CREATE FUNCTION refuse_550() RETURNS trigger LANGUAGE plpgsql AS "
                          "$$ BEGIN RAISE EXCEPTION 'chunk refused'; END $$"))
        conn.execute(text("CREATE TRIGGER refuse_550 BEFORE UPDATE ON outbox_messages FOR EACH ROW "
                          "WHEN (NEW.id = 550 AND NEW.state = 'pending') EXECUTE FUNCTION refuse_550()"))
    try:
        code, out, err = cli(capsys, monkeypatch, url_of(pg_engine), "replay", "--state", "dead", "--limit", "600",
                             "--json")
    finally:
        with pg_engine.begin() as conn:
            conn.execute(text("DROP TRIGGER refuse_550 ON outbox_messages"))
            conn.execute(text("DROP FUNCTION refuse_550()"))
    result = json.loads(out)
    assert code == 1 and result["replayed"] == list(range(1, 501)) and "chunk refused" in result["error"]
    assert "stopped part-way" in err and one_line(err)
    with pg_engine.connect() as conn:
        pending = conn.execute(text("SELECT count(*) FROM outbox_messages WHERE state = 'pending'")).scalar_one()
    assert pending == 500


def test_an_open_breaker_shows_the_failures_that_tripped_it(sqlite_engine, capsys, monkeypatch):
    from supervisor.cycle.breaker import CircuitBreakerPolicy, apply_outcomes, closed_row

    policy = CircuitBreakerPolicy()  # the defaults: a dead endpoint trips on its 10th failure
    row, _ = apply_outcomes(closed_row("acme", "https://buyer.example"), [False] * 10, now=time.time(),
                            policy=policy)
    assert row["state"] == "open"
    with sqlite_engine.begin() as conn:
        conn.execute(breakers.insert().values(**row))
    url = url_of(sqlite_engine)
    [listed] = json.loads(cli(capsys, monkeypatch, url, "breakers", "list", "--json")[1])
    assert listed["failures"] == 10
    _, out, _ = cli(capsys, monkeypatch, url, "status")
    assert "acme@https://buyer.example open (10 failures, 1 trips)" in out
    probing = {**row, "state": "half_open"}  # its open period ended; a probe goes, and fails
    again, _ = apply_outcomes(probing, [False], now=row["open_until"] + 1, policy=policy)
    assert again["state"] == "open" and again["failures"] == 11


def test_list_says_when_its_limit_cut_the_listing(sqlite_engine, capsys, monkeypatch):
    enqueue_many(sqlite_engine, "https://buyer.example/hook", [""] * 3)
    url = url_of(sqlite_engine)
    code, out, err = cli(capsys, monkeypatch, url, "list", "--limit", "2")
    assert code == 0 and len(out.splitlines()) == 3  # header + 2
    assert err == "showing the first 2 of 3 matching messages: raise --limit or narrow the filter\n"
    code, out, err = cli(capsys, monkeypatch, url, "list", "--limit", "3", "--json")
    assert code == 0 and len(json.loads(out)) == 3 and err == ""


def test_text_show_includes_the_payload_masked_as_json_show_does(sqlite_engine, capsys, monkeypatch):
    enqueue_many(sqlite_engine, "https://buyer.example/hook", [""])
    url = url_of(sqlite_engine)
    shown = json.loads(cli(capsys, monkeypatch, url, "show", "1", "--json")[1])
    code, out, _ = cli(capsys, monkeypatch, url, "show", "1")
    assert code == 0 and shown["payload"] and f"payload_size      {shown['payload_size']}" in out
    text_payload = out[out.index("payload          ") + 17:out.index("\n\n")]
    assert json.loads(text_payload) == shown["payload"]
    assert "[redacted]" in text_payload  # the buyer's token, as in the JSON view
    with sqlite_engine.connect() as conn:
        body = conn.execute(messages.select()).one().body
    token = json.loads(body)["push_notification_config"]["token"] if b"push_notification_config" in body else None
    assert token is None or token not in out


def test_purge_dry_run_counts_and_deletes_nothing(engine, capsys, monkeypatch):
    dead_with_an_attempt(engine, n=2, horizon=1.0)
    url = url_of(engine)
    monkeypatch.setenv("OUTBOX_ACTIVITY_RETENTION_DAYS", "30")
    code, out, _ = cli(capsys, monkeypatch, url, "purge", "--older-than", "30d", "--dry-run", "--json")
    assert code == 0 and json.loads(out) == {"dry_run": True, "deleted": 2, "dropped_attempt_partitions": []}
    code, out, _ = cli(capsys, monkeypatch, url, "purge", "--older-than", "30d", "--dry-run")
    assert code == 0 and out.startswith("would delete 2 finished message(s)")
    with engine.connect() as conn:
        assert conn.execute(messages.select()).all()
    code, out, _ = cli(capsys, monkeypatch, url, "purge", "--older-than", "30d", "--json")
    assert code == 0 and json.loads(out)["deleted"] == 2 and json.loads(out)["dry_run"] is False


@pytest.mark.parametrize("args", [
    ["replay"],
    ["replay", "1", "--state", "dead"],
    ["breakers", "reset"],
    ["breakers", "reset", "no-origin"],
    ["subscribers", "show", "sub_1"],
    ["breakers", "reset", "acme@not-an-origin"],
    ["breakers", "reset", "@https://b.example"],
    ["recover", "start", "--since", "6h", "--dry-run"],
    ["recover", "start", "--tenant", "acme"],
    ["recover", "start", "--tenant", "acme", "--since", "6h", "--until", "1h"],
    ["recover", "start", "--tenant", "acme", "--cancel-pending", "--reason", "gone"],
    ["recover", "start", "--tenant", "acme", "--cancel-pending", "--since", "1h", "--until", "2h"],
    ["recover", "show"],
    ["recover", "start", "--tenant", "acme", "--since", "6h", "--origin", "not-an-origin"],
    ["recover", "start", "--tenant", "acme", "--since", "6h", "--origin", "ftp://b.example"],
    ["endpoints", "--origin", "not-an-origin"],
], ids=" ".join)
def test_impossible_command_lines_exit_2_like_the_parsers_own(args, sqlite_url, capsys, monkeypatch):
    code, _, err = cli(capsys, monkeypatch, sqlite_url, *args)
    assert code == 2 and one_line(err) and f"see `outboxd {args[0]} --help`" in err, err


def test_failures_that_are_not_usage_exit_1(sqlite_url, capsys, monkeypatch):
    assert cli(capsys, monkeypatch, sqlite_url, "show", "99")[0] == 1
    assert cli(capsys, monkeypatch, sqlite_url, "breakers", "reset", "acme@https://b.example")[0] == 1


def test_an_origin_option_takes_any_url_of_the_endpoint(engine, capsys, monkeypatch):
    """A pasted webhook URL (path, trailing slash, upper case, default port) selects the
    endpoint whose origin it has, in recover and breakers alike."""
    url = url_of(engine)
    enqueue_tasks(engine, "tenant-0", "http://127.0.0.1/hook", 2)  # origin http://127.0.0.1
    dead_with_an_attempt(engine, 3)  # origin http://127.0.0.1:9; all five dead, tenant-0
    with engine.begin() as conn:
        conn.execute(breakers.insert().values(tenant_id="tenant-0", origin="http://127.0.0.1:9", state="open",
                                              failures=0, successes=0, trips=1, open_until=9e9, updated_at=1.0))
    recover = ("recover", "start", "--tenant", "tenant-0", "--since", "1970-01-01T00:00:00Z", "--json")
    for given, matched in (("http://127.0.0.1:9", 3), ("http://127.0.0.1:9/", 3), ("HTTP://127.0.0.1:9/hook?q=1", 3),
                           ("http://127.0.0.1:80/", 2), ("http://LOCALHOST.:9/", 0)):
        code, out, err = cli(capsys, monkeypatch, url, *recover, "--dry-run", "--origin", given)
        assert code == 0 and json.loads(out) == {"would_replay": matched}, (given, out, err)
    code, out, err = cli(capsys, monkeypatch, url, *recover, "--origin", "http://127.0.0.1:9/hook")
    assert code == 0 and json.loads(out)["origin"] == "http://127.0.0.1:9" and json.loads(out)["total"] == 3, err
    code, out, err = cli(capsys, monkeypatch, url, "breakers", "reset", "tenant-0@HTTP://127.0.0.1:9/hook/")
    assert code == 0 and out == "breaker tenant-0@http://127.0.0.1:9 reset (closed)\n", err


def test_a_misspelt_toml_key_gets_a_did_you_mean(tmp_path, capsys, monkeypatch):
    config = tmp_path / "outbox.toml"
    config.write_text("[outbox]\nretry_horizon_second = 86400\n")
    code, _, err = cli(capsys, monkeypatch, None, "--config", str(config), "config")
    assert code == 1 and one_line(err)
    assert "unknown setting 'retry_horizon_second'; did you mean retry_horizon_seconds?" in err


def test_a_reader_that_leaves_early_gets_no_broken_pipe_error(sqlite_engine, tmp_path):
    enqueue_many(sqlite_engine, "https://buyer.example/hook", [""] * 400)
    env = {**os.environ, "OUTBOX_DATABASE_URL": url_of(sqlite_engine), "PYTHONPATH": str(ROOT)}
    pipeline = subprocess.run(
        ["bash", "-c", f'set -o pipefail; "{sys.executable}" -m supervisor.cli list --limit 400 | head -n 1'],
        capture_output=True, text=True, env=env, timeout=120)
    assert pipeline.stdout.startswith("ID ") and pipeline.stdout.count("\n") == 1
    assert pipeline.stderr == "" and pipeline.returncode in (0, 141), (pipeline.returncode, pipeline.stderr)


def test_migrate_and_keys_list_on_sqlite_print_no_sqlalchemy_warning(tmp_path):
    env = {**os.environ, "OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'outbox.db'}", "PYTHONPATH": str(ROOT)}
    for args in (["migrate"], ["keys", "list"], ["status"]):
        done = subprocess.run([sys.executable, "-m", "supervisor.cli", *args], capture_output=True, text=True,
                              env=env, timeout=120)
        assert done.returncode == 0 and done.stderr == "", (args, done.stderr)


def test_the_demo_ends_on_its_success_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    demo = subprocess.run([sys.executable, "-m", "supervisor.cli", "demo"], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(ROOT)}, cwd=tmp_path, timeout=180)
    assert demo.returncode == 0, demo.stderr
    assert demo.stdout.rstrip().endswith("retries reused the same bytes and key") and demo.stderr == "", demo.stderr


def test_a_database_that_never_answers_fails_each_command_within_the_connect_timeout(pg_url):
    """A pooler or host that accepts the connection and never answers: at the defaults every
    operator command fails within the connect timeout (15 s) with one line, never hangs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    with stalling_proxy(pg_url) as (proxy, proxied):
        proxy.stall()
        commands = (["migrate"], ["list"], ["keys", "list"], ["status"])
        started = time.monotonic()
        running = [subprocess.Popen([sys.executable, "-m", "supervisor.cli", *args], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                    env={**env, "OUTBOX_DATABASE_URL": proxied, "PYTHONPATH": str(ROOT)})
                   for args in commands]
        try:
            ended = [(args, proc.wait(timeout=60), proc.stderr.read() if proc.stderr else "")
                     for args, proc in zip(commands, running)]
        finally:
            for proc in running:
                proc.kill()
        took = time.monotonic() - started
    for args, code, err in ended:
        assert code == 1 and one_line(err) and "connection timeout expired" in err, (args, code, err)
    assert took < 15 + 10, took


def test_reporting_without_the_sdks_tables_fails_in_one_line(fresh_db, capsys, monkeypatch):
    """The SDK's own pool raises psycopg's errors, not SQLAlchemy's: still one line, no traceback."""
    from tests.reporting_world import EXAMPLES

    assert cli(capsys, monkeypatch, fresh_db, "migrate")[0] == 0
    monkeypatch.setenv("OUTBOX_REPORTING_HANDOFF", "reporting_handoff:build")
    monkeypatch.setenv("REPORTING_TENANT_ID", "acme")
    monkeypatch.setenv("REPORTING_CIPHER_KEY", "A" * 43 + "=")
    monkeypatch.syspath_prepend(str(EXAMPLES))
    code, out, err = cli(capsys, monkeypatch, fresh_db, "reporting")
    assert code == 1 and out == "" and one_line(err), err
    assert "database error" in err and "does not exist" in err


@pytest.mark.parametrize("command", [("list", "--json"), ("replay", "--dry-run", "--state", "dead", "--json"),
                                     ("recover", "start", "--tenant", "tenant-0", "--dry-run")])
def test_a_time_given_as_a_duration_ago_counts_back_from_the_databases_clock(pg_engine, capsys, monkeypatch,
                                                                              command):
    """Times are the database's: ``--since 30m`` on an operator host whose clock is two hours
    ahead must select what ended or was enqueued in the database's last 30 minutes (it
    selected nothing, and the same for `recover start`, which may cancel what it selects)."""
    enqueue_many(pg_engine, "https://buyer.example/hook", [""] * 3)
    with pg_engine.begin() as conn:
        conn.execute(messages.update().values(state="dead", dead_reason="rejected",
                                              finished_at=messages.c.created_at))
    from supervisor.cli import common

    monkeypatch.setattr(common.time, "time", lambda: _REAL_TIME() + 7200)  # the host two hours ahead
    code, out, err = cli(capsys, monkeypatch, url_of(pg_engine), *command, "--since", "30m")
    assert code == 0, err
    if command[0] == "recover":
        assert "would replay 3 dead message(s)" in out, out
    else:
        assert len(json.loads(out) if command[0] == "list" else json.loads(out)["would_replay"]) == 3, out


_REAL_TIME = time.time
