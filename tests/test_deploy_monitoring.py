"""The monitoring files under deploy/ agree with the metric names the daemon exports: the
Grafana dashboard, the Prometheus alert rules and their unit tests, the scrape config.

``promtool`` (Debian package ``prometheus``) checks the alert rules, their unit tests, the
scrape config and every dashboard query when the machine has it; a missing promtool skips
only the test that needs it, saying which package brings it.
"""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest

from tests.deploy_files import (ALERTS, ALERTS_TEST, DASHBOARD, PROMETHEUS, ROOT, daemon_services, load_compose,
                                load_yaml, run_tool, yaml)

# The metric families the daemon exports (the contract for the dashboard and the alerts).
COUNTERS = {
    "outbox_deliveries_total",
    "outbox_attempts_total",
    "outbox_dead_letters_total",
    "outbox_breaker_transitions_total",
    "outbox_sink_errors_total",
    "outbox_lease_rescues_total",
    "outbox_database_outages_total",
    "outbox_database_errors_total",
    "outbox_reporting_handoffs_total",
    "outbox_reporting_handoff_errors_total",
}

GAUGES = {
    "outbox_messages",
    "outbox_oldest_due_message_age_seconds",
    "outbox_delivery_lag_seconds",  # the same, leaving out what breakers hold back
    "outbox_breakers",
    "outbox_breakers_holding_back",  # endpoints with pending work behind a breaker not closed
    "outbox_ready",  # 0 while /readyz fails: a daemon that waits or keeps failing is still up
    "outbox_in_flight_requests",
    "outbox_build_info",
    "outbox_signing_active_keys",  # keys able to sign now, per daemon (and scope): 0 holds webhooks
    "outbox_sealed_rows_unopenable",
    "outbox_encryption_reseal_backlog",
    "outbox_encryption_rotation_waiting_processes",
    "outbox_reporting_handoff_backlog",
}

HISTOGRAMS = {
    "outbox_attempt_duration_seconds",
    "outbox_commit_to_delivery_seconds",
    "outbox_claim_batch_size",
}

FAMILIES = COUNTERS | GAUGES | HISTOGRAMS

PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan", "atan2",
}  # fmt: skip


def _families(expr: str) -> set[str]:
    """Metric families an expression reads: every series name, with histogram suffixes folded."""
    names = set()
    for name in _series_names(expr):
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and name[: -len(suffix)] in HISTOGRAMS:
                name = name[: -len(suffix)]
        names.add(name)
    return names


def _series_names(expr: str) -> set[str]:
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group(0)
        if word.lower() in PROMQL_KEYWORDS or text[match.end() :].lstrip().startswith("("):
            continue  # a keyword or a function call
        names.add(word)
    return names


def test_families_helper():
    expr = (
        'histogram_quantile(0.95, sum by (le) (rate(outbox_attempt_duration_seconds_bucket{instance=~"$instance"}'
        '[$__rate_interval]))) / on (job) group_left sum(up{job="x"} offset 5m) > bool 1e-9'
    )
    assert _families(expr) == {"outbox_attempt_duration_seconds", "up"}
    assert _families("sum without (instance) (outbox_messages)") == {"outbox_messages"}


# --------------------------------------------------------------------------- Grafana dashboard


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _dashboard_exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", []) if "expr" in t]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if var.get("type") == "query" and isinstance(query, str):
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", query))
    return exprs


def test_dashboard_shape():
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    data_panels = [p for p in panels if p["type"] != "row"]
    assert len(data_panels) >= 10
    for panel in data_panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]


def test_dashboard_uses_only_exported_metric_families_and_all_of_them():
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    used = set()
    for expr in _dashboard_exprs(dashboard):
        families = _families(expr)
        assert families, f"no metric in {expr!r}"
        unknown = families - FAMILIES
        assert not unknown, f"unknown metric(s) {sorted(unknown)} in {expr!r}"
        used |= families
    assert used == FAMILIES, f"metrics without a panel: {sorted(FAMILIES - used)}"


def test_dashboard_reads_only_the_states_the_messages_gauge_has():
    """``outbox_messages`` is sampled from the live rows' partial indexes: pending and in_flight only."""
    live = {"pending", "in_flight"}
    selectors = [m for expr in _dashboard_exprs(json.loads(DASHBOARD.read_text(encoding="utf-8")))
                 for m in re.findall(r'outbox_messages\{([^}]*)\}', expr)]
    assert selectors
    for selector in selectors:
        states = re.search(r'state=~?"([^"]*)"', selector)
        assert states and set(states.group(1).split("|")) <= live, selector


# --------------------------------------------------------------------------- Prometheus rules


def _alert_rules() -> dict[str, dict]:
    (doc,) = load_yaml(ALERTS)
    return {rule["alert"]: rule for group in doc["groups"] for rule in group["rules"]}


def test_every_alert_rule_is_in_the_operations_guide():
    guide = (ROOT / "docs" / "operations.md").read_text().split("## Alerts", 1)[1]
    assert [name for name in _alert_rules() if f"`{name}`" not in guide] == []


def test_alert_rules_cover_the_required_conditions():
    rules = _alert_rules()
    exprs = {name: re.sub(r"\s+", " ", str(rule["expr"])).strip() for name, rule in rules.items()}

    def find(fragment: str) -> dict:
        matches = [rules[n] for n, e in exprs.items() if fragment in e]
        assert matches, f"no alert rule with {fragment!r}"
        return matches[0]

    assert find('up{job="outboxd"} == 0')["for"] == "2m"
    lag = find("max(outbox_delivery_lag_seconds)")
    assert lag["for"] == "5m" and "> 300" in lag["expr"]
    assert "> 0.1" in find("sum(rate(outbox_dead_letters_total[10m]))")["expr"]
    assert find("max(outbox_breakers_holding_back) > 0")["for"] == "10m"
    assert find("max_over_time(outbox_ready[2m]) == 0")["labels"]["severity"] == "warning"
    assert find("max(max_over_time(outbox_ready[2m])) == 0")["labels"]["severity"] == "critical"
    signature = find('increase(outbox_dead_letters_total{reason="signature_rejected"}[15m])')
    assert signature["expr"].rstrip().endswith("> 0")
    no_key = find("(outbox_signing_active_keys) == 0")
    assert no_key["labels"]["severity"] == "critical" and "docs/operations.md" in no_key["annotations"]["runbook"]
    assert find("max by (instance) (outbox_sealed_rows_unopenable) > 0")["labels"]["severity"] == "critical"


def test_alert_rules_are_documented_and_use_known_metrics():
    for name, rule in _alert_rules().items():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        annotations = rule["annotations"]
        for key in ("summary", "description"):
            assert annotations.get(key, "").strip(), f"{name} lacks {key}"
        assert annotations.get("runbook") or annotations.get("runbook_url"), f"{name} lacks a runbook hint"
        unknown = _families(str(rule["expr"])) - FAMILIES - {"up"}
        assert not unknown, f"{name}: unknown metric(s) {sorted(unknown)}"


def test_prometheus_scrapes_both_replicas_as_job_outboxd():
    (config,) = load_yaml(PROMETHEUS)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = [t for sc in jobs["outboxd"]["static_configs"] for t in sc["targets"]]
    compose = load_compose()
    for service in daemon_services(compose):
        assert any(t.startswith(f"{service}:") for t in targets), f"{service} is not scraped"
    assert all(t.endswith(":9464") for t in targets)
    assert "/etc/prometheus/alerts.yml" in config["rule_files"]


def test_the_counters_alerts_read_start_at_zero() -> None:
    """A labelled counter that first appears at 1 is lost to rate() and increase(): the first
    signature rejection (OutboxSignatureRejected) would never alert, and every restart would
    hide a dead letter from the dashboards. Known labels are exported at 0 from the start."""
    from prometheus_client import generate_latest

    from outbox.schema import DEAD_REASONS
    from supervisor.observe.metrics import Metrics

    exposed = generate_latest(Metrics().registry).decode()
    expected = [f'outbox_dead_letters_total{{reason="{reason}"}} 0.0' for reason in DEAD_REASONS] + [
        'outbox_deliveries_total{outcome="delivered"} 0.0', 'outbox_deliveries_total{outcome="dead"} 0.0',
        'outbox_attempts_total{outcome="success",status_class="2xx"} 0.0',
        'outbox_breaker_transitions_total{from_state="closed",to_state="open"} 0.0',
        'outbox_breaker_transitions_total{from_state="open",to_state="half_open"} 0.0']
    assert [line for line in expected if line not in exposed.splitlines()] == []


# --------------------------------------------------------------------------- promtool


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        reason = "promtool not on PATH; install it with: apt-get install -y prometheus"
        print(reason, file=sys.stderr)
        pytest.skip(reason)
    return path


def test_promtool_check_rules():
    result = run_tool(_promtool(), "check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rule_unit_tests():
    result = run_tool(_promtool(), "test", "rules", str(ALERTS_TEST))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_config(tmp_path):
    (config,) = load_yaml(PROMETHEUS)
    config["rule_files"] = [str(ALERTS)]  # the compose file mounts it at /etc/prometheus
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = run_tool(_promtool(), "check", "config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_parses_every_dashboard_query(tmp_path):
    """Each panel query, with Grafana's variables filled in, is valid PromQL."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", []) if "expr" in t]
    rules = [
        {
            "record": f"dashboard:query_{i}",
            "expr": expr.replace("$__rate_interval", "1m").replace("$instance", ".*"),
        }
        for i, expr in enumerate(exprs)
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_tool(_promtool(), "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
