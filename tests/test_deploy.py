"""The operational files under deploy/ parse and agree with each other: the compose file, the
image, the systemd unit, the Kubernetes base and the dependency pins (the monitoring files are
checked in tests/test_deploy_monitoring.py).

Nothing is built or started here (no container engine, no cluster). Tools are used when the
machine has them: ``systemd-analyze`` checks the units; ``kubectl`` renders the
kustomization. A missing tool skips only the test that needs it, saying which package brings it.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.deploy_files import (COMPOSE, DEPLOY, KUBE, ROOT, SYSTEMD, daemon_services, deploy_files, load_compose,
                                load_yaml, run_tool, service_command, yaml)


# --------------------------------------------------------------------------- parsing


def _yaml_files() -> list[Path]:
    return deploy_files(".yml", ".yaml")


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
    docs = load_yaml(path)
    assert docs, f"{path} is empty"
    assert all(isinstance(doc, dict) for doc in docs), f"{path}: every document must be a mapping"


@pytest.mark.parametrize("path", deploy_files(".json"), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_json_file_parses(path):
    assert isinstance(json.loads(path.read_text(encoding="utf-8")), dict)


# --------------------------------------------------------------------------- compose



def test_compose_runs_two_daemons_after_a_one_shot_migrate():
    compose = load_compose()
    services = compose["services"]
    daemons = daemon_services(compose)
    replicas = sum(services[name].get("deploy", {}).get("replicas", 1) for name in daemons)
    assert replicas == 2, f"expected two outboxd daemon replicas, got {daemons}"

    migrate = services["migrate"]
    assert service_command(migrate) == ["migrate"]
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
    services = load_compose()["services"]
    console = services["console"]
    assert service_command(console) == ["ui"] and console["build"]["dockerfile"] == "deploy/Dockerfile"
    assert console["environment"]["OUTBOX_UI_ADDR"].endswith(":8465")
    assert console["environment"]["OUTBOX_UI_TOKEN"].startswith("${OUTBOX_UI_TOKEN:?")  # never a default token
    assert all(p.startswith("127.0.0.1:") for p in console["ports"])
    assert "/login" in " ".join(console["healthcheck"]["test"])


def test_compose_mounts_monitoring_files_that_exist():
    services = load_compose()["services"]
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
    (datasources,) = load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")
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
        (doc,) = load_yaml(DEPLOY / "kubernetes" / manifest)
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
    result = run_tool(tool, "verify", *(f"./{n}" for n in names), cwd=tmp_path)
    output = result.stdout + result.stderr
    problems = [line for line in output.splitlines() if any(n in line for n in names)]
    assert result.returncode == 0 and not problems, output


def test_the_systemd_unit_leaves_the_process_metrics_their_proc_files():
    unit = (DEPLOY / "systemd" / "outboxd.service").read_text()
    assert not re.search(r"^ProcSubset=pid", unit, re.M)  # hides /proc/stat: every process_* metric gone


# --------------------------------------------------------------------------- Kubernetes


def _kube_objects() -> dict[tuple[str, str], dict]:
    (kustomization,) = load_yaml(KUBE / "kustomization.yaml")
    objects = {}
    for resource in kustomization["resources"]:
        for doc in load_yaml(KUBE / resource):
            objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def test_kustomization_lists_every_manifest_and_stays_namespace_agnostic():
    (kustomization,) = load_yaml(KUBE / "kustomization.yaml")
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
    (example,) = [d for d in load_yaml(KUBE / "secrets.example.yaml")
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
    result = run_tool(tool, "kustomize", str(KUBE))
    if result.returncode != 0 and "unknown command" in result.stderr:
        pytest.skip("this kubectl has no kustomize")
    assert result.returncode == 0, result.stderr
    kinds = sorted(doc["kind"] for doc in yaml.safe_load_all(result.stdout) if doc)
    assert kinds == ["ConfigMap", "Deployment", "Job", "PodDisruptionBudget", "Service", "ServiceAccount"]


def test_the_kubernetes_base_deploys_this_release():
    import tomllib
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    (kustomization,) = load_yaml(DEPLOY / "kubernetes" / "kustomization.yaml")
    assert [image["newTag"] for image in kustomization["images"]] == [version]


def test_constraints_pin_every_runtime_dependency_as_tested():
    """deploy/constraints.txt is what scripts/constraints.py makes from this environment."""
    result = subprocess.run([sys.executable, str(DEPLOY.parent / "scripts" / "constraints.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    pins = dict(line.split("==") for line in (DEPLOY / "constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    for name in ("sqlalchemy", "psycopg", "psycopg-binary", "greenlet", "httpx", "cryptography", "structlog"):
        assert name in pins, name
