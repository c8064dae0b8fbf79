"""Numeric settings: one bounds table, NaN/infinity/out-of-range refused in one line naming the
variable; and JSON logs that keep the traceback of a logged exception."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import typing
import warnings
from dataclasses import fields
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox.config import NUMERIC_BOUNDS, Settings, load_settings
from outbox.errors import ConfigurationError

ROOT = Path(__file__).resolve().parent.parent
HINTS = typing.get_type_hints(Settings)
NUMERIC = sorted(f.name for f in fields(Settings) if HINTS[f.name] in (int, float))


def var(name: str) -> str:
    return "OUTBOX_" + name.upper()


def test_every_numeric_setting_has_bounds() -> None:
    """A numeric setting added without an entry would escape validation: fail here instead."""
    assert NUMERIC and sorted(NUMERIC_BOUNDS) == NUMERIC


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("lease_seconds", "nan"),
        ("lease_seconds", "NaN"),
        ("connect_timeout_seconds", "-1"),
        ("read_timeout_seconds", "0"),
        ("sink_timeout_seconds", "inf"),
        ("poll_interval_seconds", "-inf"),
        ("database_outage_seconds", "1e400"),
        ("database_outage_seconds", "2147484"),  # past PostgreSQL's statement_timeout: no connection would open
        ("database_outage_seconds", "0.0001"),  # 0 ms would turn the server-side timeout off
        ("database_outage_seconds", "0.5"),  # every statement slower than that would count as an outage
        ("breaker_failure_threshold", "0"),
        ("breaker_success_threshold", "-3"),
        ("concurrency", "0"),
        ("retry_horizon_seconds", "86399"),
        ("retry_horizon_seconds", "604801"),
        ("retry_max_seconds", "1"),  # below the 2 s retry base
        ("breaker_max_open_seconds", "20"),  # below the 30 s open time
        ("connect_timeout_seconds", "25"),  # the lease (30 s) would not exceed connect + read
        ("claim_batch", "2.5"),
        ("shutdown_grace_seconds", "soon"),
    ],
)
def test_bad_values_are_refused_naming_the_variable(name: str, raw: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        load_settings(env={var(name): raw})
    message = str(caught.value)
    assert var(name) in message and "\n" not in message


@pytest.mark.parametrize(("variable", "raw"), [
    ("OUTBOX_METRICS_ADDR", "127.0.0.1:99999"),  # the socket would wrap it to 34463
    ("OUTBOX_METRICS_ADDR", "127.0.0.1:65536"),
    ("OUTBOX_METRICS_ADDR", "127.0.0.1:-1"),
    ("OUTBOX_METRICS_ADDR", "127.0.0.1:\u00b9"),  # a digit to str.isdigit, not to int()
    ("OUTBOX_METRICS_ADDR", "9464"),
    ("OUTBOX_UI_ADDR", "127.0.0.1:99999"),
    ("OUTBOX_UI_ADDR", "127.0.0.1:0"),  # a free port the printed address could not name
    ("OUTBOX_METRICS_ADDR", "http://127.0.0.1:9100"),  # a URL, not an address to bind
    ("OUTBOX_METRICS_ADDR", "a b:80"),
    ("OUTBOX_UI_ADDR", "[::1:80"),  # brackets that do not close
    ("OUTBOX_UI_ADDR", "::1:80"),  # an IPv6 address without its brackets: where does the port start?
    ("OUTBOX_UI_ADDR", "[example.com]:80"),  # brackets hold an IPv6 address only
])
def test_an_address_with_no_port_to_bind_is_refused_naming_the_variable(variable: str, raw: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        load_settings(env={variable: raw})
    message = str(caught.value)
    assert message.startswith(variable) and "65535" in message and "\n" not in message


@pytest.mark.parametrize(("variable", "raw", "words"), [
    ("OUTBOX_ALLOW_HTTP", "Y", "must be true or false (or 1/0, yes/no, on/off), got 'Y'"),
    ("OUTBOX_CONCURRENCY", "5_0", "'5_0' is not a valid int"),  # int() reads 50
    ("OUTBOX_CONCURRENCY", "\u0663", "is not a valid int"),  # an Arabic-Indic 3 to int()
])
def test_values_python_would_read_but_no_one_writes_are_refused(variable: str, raw: str, words: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(words)):
        load_settings(env={variable: raw})


@pytest.mark.parametrize("raw", ["not a url", "ftp://agent.example", "https://u:hunter2@agent.example/mcp"])
def test_a_seller_agent_url_is_checked_at_start_not_at_the_first_registration(raw: str) -> None:
    with pytest.raises(ConfigurationError, match="OUTBOX_SELLER_AGENT_URL") as caught:
        load_settings(env={"OUTBOX_SELLER_AGENT_URL": raw})
    assert "hunter2" not in str(caught.value)
    assert load_settings(env={"OUTBOX_SELLER_AGENT_URL": "https://agent.example/mcp"}).seller_agent_url


def test_addresses_that_are_legal() -> None:
    s = load_settings(env={"OUTBOX_METRICS_ADDR": "[::1]:0", "OUTBOX_UI_ADDR": "0.0.0.0:65535"})
    assert (s.metrics_addr, s.ui_addr) == ("[::1]:0", "0.0.0.0:65535")
    for legal in (":9464", "localhost:9464", "outboxd-0.outboxd.svc:9464", "[fe80::1]:9464"):
        assert load_settings(env={"OUTBOX_METRICS_ADDR": legal}).metrics_addr == legal
    assert load_settings(env={"OUTBOX_METRICS_ADDR": ""}).metrics_addr in ("", None)  # empty: no endpoint


@pytest.mark.parametrize("raw", ["", "outbox.db", "mysql://u:hunter2@db/outbox", "postgresql:/host/db",
                                 "admin:hunter2@db.internal:5432/outbox", "hunter2"])
def test_a_database_url_that_is_not_one_is_refused_naming_the_variable_not_its_secret(raw: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        load_settings(env={"OUTBOX_DATABASE_URL": raw})
    message = str(caught.value)
    assert message.startswith("OUTBOX_DATABASE_URL") and "hunter2" not in message and "\n" not in message


def test_database_urls_of_both_databases_and_their_drivers_are_legal() -> None:
    for raw in ("sqlite:///outbox.db", "sqlite://", "postgresql://u@h/db", "postgres://u@h/db",
                "postgresql+psycopg://u@h/db", "SQLite:///x.db"):
        assert load_settings(env={"OUTBOX_DATABASE_URL": raw}).database_url


def test_database_urls_read_postgres_as_postgresql_for_listening_too() -> None:
    settings = load_settings(env={"OUTBOX_DATABASE_URL": "postgres://u@h/db",
                                  "OUTBOX_LISTEN_DATABASE_URL": "postgres://u@h:5433/db"})
    assert settings.listen_database_url == "postgresql://u@h:5433/db"
    with pytest.raises(ConfigurationError, match="OUTBOX_LISTEN_DATABASE_URL"):
        load_settings(env={"OUTBOX_DATABASE_URL": "postgres://u@h/db", "OUTBOX_LISTEN_DATABASE_URL": "postgresqlx://h"})


def test_top_level_settings_and_an_outbox_table_in_one_file_are_all_read(tmp_path: Path) -> None:
    """Settings are top-level keys, keys of ``[outbox]``, or both: ``[outbox.tenant_signing_keys]``
    beside top-level keys must not make the file's other settings vanish."""
    path = tmp_path / "outbox.toml"
    path.write_text('database_url = "postgresql://u@h/db"\nconcurrency = 7\nallow_http = true\n'
                    '[outbox.tenant_signing_keys]\nacme = { file = "k.pem", key_id = "acme-1" }\n')
    settings = load_settings(path, env={})
    assert (settings.database_url, settings.concurrency, settings.allow_http) == ("postgresql://u@h/db", 7, True)
    assert settings.tenant_signing_keys == {"acme": ("k.pem", "acme-1")}
    path.write_text('concurrency = 7\n[outbox]\nconcurrency = 8\n')
    with pytest.raises(ConfigurationError, match="concurrency.*twice"):
        load_settings(path, env={})
    for body in ("outbox = 5\n", 'outbox = "x"\n'):
        path.write_text(body)
        with pytest.raises(ConfigurationError, match="must be a table"):
            load_settings(path, env={})


def test_config_masks_every_secret_a_url_setting_can_hold() -> None:
    from outbox.config import effective
    shown = json.dumps(effective(load_settings(env={
        "OUTBOX_DATABASE_URL": "postgresql+psycopg://u:hunter1@h/db?password=hunter2&sslmode=require",
        "OUTBOX_OPERATOR_EVENTS_URL": "https://hooks.slack.com/services/T000/B000/hunter3?token=hunter4",
    })))
    assert not any(f"hunter{i}" in shown for i in range(1, 5)), shown
    assert "sslmode=require" in shown and "https://hooks.slack.com/" in shown


def test_a_key_cache_window_below_the_adcp_ceiling_is_warned_about() -> None:
    from outbox.config import ConfigurationWarning
    with pytest.warns(ConfigurationWarning, match="below the 1800 s AdCP lets buyers cache a JWKS"):
        load_settings(env={"OUTBOX_KEY_CACHE_WINDOW_SECONDS": "0"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_settings(env={"OUTBOX_KEY_CACHE_WINDOW_SECONDS": "1800"})


def test_a_first_retry_past_the_horizon_is_refused_naming_both() -> None:
    """A message would get one attempt and die: no retry schedule fits in the horizon."""
    with pytest.raises(ConfigurationError, match="OUTBOX_RETRY_BASE_SECONDS.*OUTBOX_RETRY_HORIZON_SECONDS"):
        load_settings(env={var("retry_base_seconds"): "86400", var("retry_max_seconds"): "90000"})


def test_a_per_origin_cap_above_the_whole_process_is_warned_about() -> None:
    from outbox.config import ConfigurationWarning
    with pytest.warns(ConfigurationWarning, match="OUTBOX_ENDPOINT_CONCURRENCY=16 .* OUTBOX_CONCURRENCY=4"):
        load_settings(env={var("endpoint_concurrency"): "16", var("concurrency"): "4"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_settings(env={var("endpoint_concurrency"): "4", var("concurrency"): "4"})


def test_toml_numbers_are_checked_alike(tmp_path: Path) -> None:
    path = tmp_path / "outbox.toml"
    for line in ("lease_seconds = nan", "concurrency = 2.5", "breaker_failure_threshold = true"):
        path.write_text(f"[outbox]\n{line}\n")
        with pytest.raises(ConfigurationError, match=var(line.split()[0])):
            load_settings(path, env={})


def test_direct_construction_is_checked_too() -> None:
    with pytest.raises(ConfigurationError, match="OUTBOX_LEASE_SECONDS"):
        Settings(lease_seconds=math.nan)


def test_edges_that_are_legal() -> None:
    s = load_settings(env={var("shutdown_grace_seconds"): "0", var("retry_after_cap_seconds"): "0",
                           var("retry_horizon_seconds"): "604800", var("breaker_failure_threshold"): "1"})
    assert (s.shutdown_grace_seconds, s.retry_after_cap_seconds, s.retry_horizon_seconds) == (0, 0, 604_800)


ENV_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-10**7, 10**7).map(str),
    st.sampled_from(["nan", "inf", "-inf", "Infinity", "1e309", "-0", "0", "0.0", "1", " 5 ", "", "x", "1_0"]),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(NUMERIC), raw=ENV_VALUES)
def test_any_env_value_is_legal_or_one_line_naming_it(name: str, raw: str) -> None:
    try:
        loaded = load_settings(env={var(name): raw})
    except ConfigurationError as exc:
        message = str(exc)
        assert "\n" not in message and message.startswith("OUTBOX_")
        # the variable itself, or the lease rule that names the timeouts it depends on
        assert var(name) in message
        return
    value = getattr(loaded, name)
    assert isinstance(value, HINTS[name]) and not isinstance(value, bool)
    assert math.isfinite(value) and value == float(raw)  # what was written, parsed, nothing else
    bounds = NUMERIC_BOUNDS[name]
    assert (value > bounds.low if bounds.low_open else value >= bounds.low) and value <= bounds.high
    if name in ("connect_timeout_seconds", "read_timeout_seconds", "lease_seconds"):
        assert loaded.lease_seconds > loaded.connect_timeout_seconds + loaded.read_timeout_seconds
    if "timeout" in name or "threshold" in name or name == "lease_seconds":
        assert value > 0  # independent of the table: zero or less never makes sense here


def test_json_logs_carry_the_traceback_without_locals() -> None:
    script = (
        "import structlog\n"
        "from supervisor.observe.logs import configure_logging\n"
        "configure_logging('json')\n"
        "def deep(secret):\n"
        "    raise RuntimeError('boom')\n"
        "try:\n"
        "    deep('hunter2-credential')\n"
        "except RuntimeError:\n"
        "    structlog.get_logger('t').exception('attempt.crashed', message_id=7)\n"
    )
    stderr = _stderr_of(script)
    line = json.loads(stderr.strip().splitlines()[-1])
    assert line["event"] == "attempt.crashed" and "exc_info" not in line
    (exc,) = line["exception"]
    assert exc["exc_type"] == "RuntimeError" and exc["exc_value"] == "boom"
    assert [f["name"] for f in exc["frames"]][-1] == "deep"
    assert "hunter2-credential" not in stderr  # frame locals are never rendered


def test_old_encryption_keys_without_a_sealing_key_are_refused_not_ignored() -> None:
    import base64

    old = base64.b64encode(b"k" * 32).decode()
    with pytest.raises(ConfigurationError) as caught:
        load_settings(env={"OUTBOX_ENCRYPTION_OLD_KEYS": old})
    message = str(caught.value)
    assert message.startswith("OUTBOX_ENCRYPTION_OLD_KEYS is set without OUTBOX_ENCRYPTION_KEY") and old not in message
    assert load_settings(env={"OUTBOX_ENCRYPTION_KEY": base64.b64encode(b"n" * 32).decode(),
                              "OUTBOX_ENCRYPTION_OLD_KEYS": old}).encryption_old_keys == (b"k" * 32,)


def test_a_librarys_standard_logging_comes_out_as_json_lines_too() -> None:
    """psycopg and asyncio log through the standard library: in a JSON log their lines must be
    JSON too (with the logger's name), or a log shipper reading JSON drops or mangles them."""
    script = (
        "import logging\n"
        "from supervisor.observe.logs import configure_logging\n"
        "configure_logging('json')\n"
        "logging.getLogger('psycopg').warning('query not terminated after cancellation: closing connection')\n"
        "try:\n"
        "    raise ValueError('inner')\n"
        "except ValueError:\n"
        "    logging.getLogger('asyncio').exception('Task exception was never retrieved')\n"
        "logging.getLogger('psycopg').info('below the level: not written')\n"
    )
    lines = [json.loads(line) for line in _stderr_of(script).strip().splitlines()]
    assert [(x["logger"], x["level"], x["event"]) for x in lines] == [
        ("psycopg", "warning", "query not terminated after cancellation: closing connection"),
        ("asyncio", "error", "Task exception was never retrieved")]
    assert lines[1]["exception"][0]["exc_value"] == "inner" and "timestamp" in lines[0]


def _stderr_of(script: str) -> str:
    """What a fresh interpreter running ``script`` writes to stderr (logging set up anew)."""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stderr
