"""The operational files under deploy/ parse, agree with each other and with the metric names.

Nothing is built or started here (no container engine, no cluster). Tools are used when the
machine has them: ``promtool`` (Debian package ``prometheus``) checks the alert rules, their
unit tests, the scrape config and every dashboard query; ``systemd-analyze`` checks the units;
``kubectl`` renders the kustomization. A missing tool skips only the test that needs it,
saying which package brings it.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read deploy/ (pip install pyyaml)")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "outboxd.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERTS_TEST = DEPLOY / "prometheus" / "alerts_test.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
KUBE = DEPLOY / "kubernetes"
SYSTEMD = DEPLOY / "systemd"

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


# --------------------------------------------------------------------------- parsing


def _deploy_files(*suffixes: str) -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in suffixes)


def _yaml_files() -> list[Path]:
    return _deploy_files(".yml", ".yaml")


def _load_yaml(path: Path) -> list:
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def test_deploy_tree_has_the_expected_files():
    expected = [
        "Dockerfile",
        "docker-compose.yml",
        "systemd/outboxd.service",
        "kubernetes/kustomization.yaml",
        "prometheus/alerts.yml",
        "prometheus/prometheus.yml",
        "grafana/dashboards/outboxd.json",
    ]
    missing = [name for name in expected if not (DEPLOY / name).is_file()]
    assert not missing, f"missing under deploy/: {missing}"


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_parses(path):
    docs = _load_yaml(path)
    assert docs, f"{path} is empty"
    assert all(isinstance(doc, dict) for doc in docs), f"{path}: every document must be a mapping"


@pytest.mark.parametrize("path", _deploy_files(".json"), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_json_file_parses(path):
    assert isinstance(json.loads(path.read_text(encoding="utf-8")), dict)


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


# --------------------------------------------------------------------------- Prometheus rules


def _alert_rules() -> dict[str, dict]:
    (doc,) = _load_yaml(ALERTS)
    return {rule["alert"]: rule for group in doc["groups"] for rule in group["rules"]}


def test_the_systemd_unit_leaves_the_process_metrics_their_proc_files():
    unit = (DEPLOY / "systemd" / "outboxd.service").read_text()
    assert not re.search(r"^ProcSubset=pid", unit, re.M)  # hides /proc/stat: every process_* metric gone


def test_the_kubernetes_base_deploys_this_release():
    import tomllib
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    (kustomization,) = _load_yaml(DEPLOY / "kubernetes" / "kustomization.yaml")
    assert [image["newTag"] for image in kustomization["images"]] == [version]


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


def test_dashboard_reads_only_the_states_the_messages_gauge_has():
    """``outbox_messages`` is sampled from the live rows' partial indexes: pending and in_flight only."""
    live = {"pending", "in_flight"}
    selectors = [m for expr in _dashboard_exprs(json.loads(DASHBOARD.read_text(encoding="utf-8")))
                 for m in re.findall(r'outbox_messages\{([^}]*)\}', expr)]
    assert selectors
    for selector in selectors:
        states = re.search(r'state=~?"([^"]*)"', selector)
        assert states and set(states.group(1).split("|")) <= live, selector


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
    (config,) = _load_yaml(PROMETHEUS)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = [t for sc in jobs["outboxd"]["static_configs"] for t in sc["targets"]]
    compose = _compose()
    for service in _daemon_services(compose):
        assert any(t.startswith(f"{service}:") for t in targets), f"{service} is not scraped"
    assert all(t.endswith(":9464") for t in targets)
    assert "/etc/prometheus/alerts.yml" in config["rule_files"]


# --------------------------------------------------------------------------- promtool


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        reason = "promtool not on PATH; install it with: apt-get install -y prometheus"
        print(reason, file=sys.stderr)
        pytest.skip(reason)
    return path


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_promtool_check_rules():
    result = _run(_promtool(), "check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rule_unit_tests():
    result = _run(_promtool(), "test", "rules", str(ALERTS_TEST))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_config(tmp_path):
    (config,) = _load_yaml(PROMETHEUS)
    config["rule_files"] = [str(ALERTS)]  # the compose file mounts it at /etc/prometheus
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = _run(_promtool(), "check", "config", str(path))
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
    result = _run(_promtool(), "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- compose


def _compose() -> dict:
    (doc,) = _load_yaml(COMPOSE)
    return doc


def _command(service: dict) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else list(command)


def _daemon_services(compose: dict) -> list[str]:
    return [
        name
        for name, service in compose["services"].items()
        if "build" in service and _command(service) == ["run"]
    ]


def test_compose_runs_two_daemons_after_a_one_shot_migrate():
    compose = _compose()
    services = compose["services"]
    daemons = _daemon_services(compose)
    replicas = sum(services[name].get("deploy", {}).get("replicas", 1) for name in daemons)
    assert replicas == 2, f"expected two outboxd daemon replicas, got {daemons}"

    migrate = services["migrate"]
    assert _command(migrate) == ["migrate"]
    assert str(migrate.get("restart", "no")) == "no"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["postgres"]["image"].startswith("postgres:16")
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])

    for name in daemons:
        daemon = services[name]
        assert daemon["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name
        key_file = daemon["environment"]["OUTBOX_SIGNING_KEY_FILE"]
        assert any(f":{Path(key_file).parent}:ro" in v for v in daemon["volumes"]), (name, key_file)
        for key in ("OUTBOX_DATABASE_URL", "OUTBOX_SIGNING_KEY_ID", "OUTBOX_METRICS_ADDR",
                    "OUTBOX_RETRY_HORIZON_SECONDS"):
            assert key in daemon["environment"], (name, key)
        assert daemon["environment"]["OUTBOX_DATABASE_URL"].startswith("postgresql")
        assert daemon["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (COMPOSE.parent / daemon["build"]["context"] / "pyproject.toml").is_file() or (
            COMPOSE.parent / daemon["build"]["context"]
        ).resolve() == ROOT
    assert "secrets" not in compose  # file secrets keep the host's mode: the keys are a read-only directory mount


def test_compose_header_never_makes_a_private_key_world_readable():
    header = [line for line in COMPOSE.read_text(encoding="utf-8").splitlines() if line.startswith("#")]
    modes = [m for line in header for m in re.findall(r"chmod\s+(?:-R\s+)?(0?[0-7]{3})", line)]
    assert modes and all(int(m, 8) & 0o077 == 0 for m in modes), modes
    assert any("chown" in line and "10001" in line for line in header)


def test_compose_runs_the_console_from_the_same_image():
    services = _compose()["services"]
    console = services["console"]
    assert _command(console) == ["ui"] and console["build"]["dockerfile"] == "deploy/Dockerfile"
    assert console["environment"]["OUTBOX_UI_ADDR"].endswith(":8465")
    assert console["environment"]["OUTBOX_UI_TOKEN"].startswith("${OUTBOX_UI_TOKEN:?")  # never a default token
    assert all(p.startswith("127.0.0.1:") for p in console["ports"])
    assert "/login" in " ".join(console["healthcheck"]["test"])


def test_compose_mounts_monitoring_files_that_exist():
    services = _compose()["services"]
    mounts = {
        name: [v.split(":")[0] for v in services[name]["volumes"] if v.startswith("./")]
        for name in ("prometheus", "grafana")
    }
    for name, sources in mounts.items():
        for source in sources:
            assert (COMPOSE.parent / source).exists(), f"{name} mounts missing {source}"
    assert "./prometheus/alerts.yml" in mounts["prometheus"]
    assert "./prometheus/prometheus.yml" in mounts["prometheus"]
    assert "./grafana/provisioning" in mounts["grafana"]
    assert "./grafana/dashboards" in mounts["grafana"]
    (datasources,) = _load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"


# --------------------------------------------------------------------------- Dockerfile


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text(encoding="utf-8").replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile_contract():
    instructions = _dockerfile_instructions()
    by_kind: dict[str, list[str]] = {}
    for keyword, rest in instructions:
        by_kind.setdefault(keyword, []).append(rest)
    args = dict(a.split("=", 1) for a in by_kind.get("ARG", []) if "=" in a)
    froms = [re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), f) for f in by_kind["FROM"]]
    assert len(froms) >= 2 and all(f.startswith("python:3.11-slim") for f in froms), froms
    user = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), by_kind["USER"][-1])
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), f"USER must be numeric uid:gid (runAsNonRoot), got {user}"
    for manifest in ("deployment.yaml", "migrate-job.yaml"):
        (doc,) = _load_yaml(DEPLOY / "kubernetes" / manifest)
        pod = doc["spec"]["template"]["spec"]["securityContext"]
        assert f"{pod['runAsUser']}:{pod['runAsGroup']}" == user, manifest
    assert any("pip install -c deploy/constraints.txt '.[ui]'" in r for r in by_kind["RUN"])  # with the console
    # An init as PID 1: the kernel drops a signal to a PID 1 without a handler, so outboxd as
    # PID 1 (Kubernetes has no --init) lost a SIGTERM that came while it started.
    assert json.loads(by_kind["ENTRYPOINT"][-1]) == ["/usr/bin/tini", "--", "outboxd"]
    runtime = instructions[max(i for i, (k, _) in enumerate(instructions) if k == "FROM"):]
    assert any(k == "RUN" and "apt-get install -y --no-install-recommends tini" in r for k, r in runtime)
    assert json.loads(by_kind["CMD"][-1]) == ["run"]
    assert "9464" in by_kind["EXPOSE"][-1].split()
    assert "OUTBOX_METRICS_ADDR=0.0.0.0:9464" in " ".join(by_kind["ENV"])
    assert "/healthz" in by_kind["HEALTHCHECK"][-1] and "curl" not in by_kind["HEALTHCHECK"][-1]


def _healthcheck_argv() -> list[str]:
    (check,) = [rest for keyword, rest in _dockerfile_instructions() if keyword == "HEALTHCHECK"]
    return json.loads(check[check.index("CMD") + 3 :].strip())


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_dockerfile_healthcheck_really_probes_healthz(status, healthy):
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        argv = _healthcheck_argv()
        assert argv[0] == "python"
        env = {**os.environ, "OUTBOX_METRICS_ADDR": f"0.0.0.0:{server.server_port}"}
        result = subprocess.run([sys.executable, *argv[1:]], env=env, capture_output=True, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert (result.returncode == 0) is healthy, result.stderr


def test_dockerfile_context_keeps_the_package_sources():
    """The repository root's .dockerignore (BuildKit and the classic builder both read it)."""
    assert not (DEPLOY / "Dockerfile.dockerignore").exists()  # it would take precedence over the root one
    ignore = (ROOT / ".dockerignore").read_text(encoding="utf-8").split()
    assert ignore.index("*") < ignore.index("!pyproject.toml")  # everything out, then the sources back in
    for needed in ("!pyproject.toml", "!README.md", "!LICENSE", "!outbox/", "!supervisor/", "!sinks/",
                   "!deploy/constraints.txt"):
        assert needed in ignore
    for kept_out in ("**/*.pem", "**/*.db"):
        assert kept_out in ignore


# --------------------------------------------------------------------------- systemd


def _unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{path.name}: bad line {raw!r}"
        current.append((key.strip(), value.strip()))
    return sections


def _seconds(value: str) -> float:
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*(ms|min|s|m|h)?", value):
        total += float(number) * {"ms": 0.001, "min": 60, "m": 60, "h": 3600}.get(unit, 1)
    return total


def test_systemd_unit_contract():
    unit = _unit(SYSTEMD / "outboxd.service")
    service = dict(unit["Service"])  # last value wins, as for single-valued settings
    assert service["Type"] == "simple"
    assert service["ExecStart"].split()[-1] == "run" and service["ExecStart"].split()[0].endswith("/outboxd")
    assert service["EnvironmentFile"].lstrip("-") == "/etc/outboxd/outboxd.env"
    assert service["Restart"] == "always"
    assert service.get("DynamicUser") == "yes" or service.get("User") not in (None, "root")
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
    }.items():
        assert service.get(key) == value, key
    assert _seconds(service["TimeoutStopSec"]) > 15, "must exceed the daemon's 15 s shutdown grace"
    # The keys reach the DynamicUser through LoadCredential=ID:DIRECTORY: systemd loads every file
    # of the directory as credential ID_FILE, at %d/ID_FILE (systemd.exec(5)). The keyring records
    # that path, so a key added to the directory is at a path known before the restart loads it.
    (credential,) = [v for k, v in unit["Service"] if k == "LoadCredential"]
    name, _, directory = credential.partition(":")
    assert directory == "/etc/outboxd/keys" and not directory.endswith((".pem", ".jwk"))
    environment = dict(v.split("=", 1) for k, v in unit["Service"] if k == "Environment")
    assert environment["OUTBOX_SIGNING_KEY_FILE"] == f"%d/{name}_signing-key.pem"
    header = (SYSTEMD / "outboxd.service").read_text(encoding="utf-8")
    assert "--out /etc/outboxd/keys/signing-key.pem" in header
    assert "WantedBy" in dict(unit["Install"])


def test_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not on PATH (Debian package systemd)")
    names = []
    for unit in sorted(SYSTEMD.glob("*.service")):
        # The binary and env file exist only on a real install: point at stand-ins.
        text = unit.read_text(encoding="utf-8").replace("/opt/outboxd/bin/outboxd", "/bin/true")
        text = text.replace("EnvironmentFile=/etc/outboxd/", "EnvironmentFile=-/etc/outboxd/")
        (tmp_path / unit.name).write_text(text)
        names.append(unit.name)
    result = _run(tool, "verify", *(f"./{n}" for n in names), cwd=tmp_path)
    output = result.stdout + result.stderr
    problems = [line for line in output.splitlines() if any(n in line for n in names)]
    assert result.returncode == 0 and not problems, output


# --------------------------------------------------------------------------- Kubernetes


def _kube_objects() -> dict[tuple[str, str], dict]:
    (kustomization,) = _load_yaml(KUBE / "kustomization.yaml")
    objects = {}
    for resource in kustomization["resources"]:
        for doc in _load_yaml(KUBE / resource):
            objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def test_kustomization_lists_every_manifest_and_stays_namespace_agnostic():
    (kustomization,) = _load_yaml(KUBE / "kustomization.yaml")
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk - {n for n in on_disk if ".example." in n}
    assert "namespace" not in kustomization
    for (kind, name), obj in _kube_objects().items():
        assert "namespace" not in obj["metadata"], f"{kind}/{name} pins a namespace"


def _pod_env(container: dict) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


def test_kubernetes_deployment_contract():
    objects = _kube_objects()
    deployment = objects[("Deployment", "outboxd")]
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    assert spec["replicas"] == 2
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert pod["terminationGracePeriodSeconds"] == 30
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["args"] == ["run"]
    assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in container["ports"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["runAsNonRoot"] is True
    assert container["resources"]["requests"] and container["resources"]["limits"]

    config_name = container["envFrom"][0]["configMapRef"]["name"]
    config = objects[("ConfigMap", config_name)]["data"]
    db = _pod_env(container)["OUTBOX_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    assert db["name"] and db["key"]
    assert "OUTBOX_DATABASE_URL" not in config, "the database URL carries a password: Secret only"

    key_mount = next(m for m in container["volumeMounts"] if m["name"] == "signing-key")
    assert key_mount["readOnly"] is True
    assert "subPath" not in key_mount  # a subPath mount never sees a key added to the Secret
    key_volume = next(v for v in pod["volumes"] if v["name"] == "signing-key")
    assert key_volume["secret"]["secretName"]
    # Every key of the Secret is a file of the mount, so a rotated-in key appears in running pods
    # at a path every replica shares (the keyring records paths).
    assert "items" not in key_volume["secret"]
    (example,) = [d for d in _load_yaml(KUBE / "secrets.example.yaml")
                  if d["metadata"]["name"] == key_volume["secret"]["secretName"]]
    assert config["OUTBOX_SIGNING_KEY_FILE"] in {f"{key_mount['mountPath']}/{k}" for k in example["stringData"]}
    assert config["OUTBOX_METRICS_ADDR"].endswith(":9464")
    assert {"OUTBOX_SIGNING_KEY_ID", "OUTBOX_RETRY_HORIZON_SECONDS"} <= config.keys()


def test_kubernetes_pdb_service_and_migrate_job():
    objects = _kube_objects()
    pod_labels = objects[("Deployment", "outboxd")]["spec"]["template"]["metadata"]["labels"]
    (pdb,) = [o for (kind, _), o in objects.items() if kind == "PodDisruptionBudget"]
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # a not-ready pod never blocks a node drain
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (service,) = [o for (kind, _), o in objects.items() if kind == "Service"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["name"] == "metrics" and service["spec"]["ports"][0]["port"] == 9464
    (job,) = [o for (kind, _), o in objects.items() if kind == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["migrate"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("OnFailure", "Never")
    assert "OUTBOX_DATABASE_URL" in _pod_env(container)
    assert not (job["spec"]["template"]["metadata"]["labels"].items()
                >= pdb["spec"]["selector"]["matchLabels"].items()), (
        "the migrate Job's pod must not count toward the daemon's PodDisruptionBudget"
    )


def test_kubectl_kustomize_renders():
    tool = shutil.which("kubectl")
    if tool is None:
        pytest.skip("kubectl not on PATH")
    result = _run(tool, "kustomize", str(KUBE))
    if result.returncode != 0 and "unknown command" in result.stderr:
        pytest.skip("this kubectl has no kustomize")
    assert result.returncode == 0, result.stderr
    kinds = sorted(doc["kind"] for doc in yaml.safe_load_all(result.stdout) if doc)
    assert kinds == ["ConfigMap", "Deployment", "Job", "PodDisruptionBudget", "Service", "ServiceAccount"]


def test_constraints_pin_every_runtime_dependency_as_tested():
    """deploy/constraints.txt is what scripts/constraints.py makes from this environment."""
    result = subprocess.run([sys.executable, str(DEPLOY.parent / "scripts" / "constraints.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    pins = dict(line.split("==") for line in (DEPLOY / "constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    for name in ("sqlalchemy", "psycopg", "psycopg-binary", "greenlet", "httpx", "cryptography", "structlog"):
        assert name in pins, name


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
