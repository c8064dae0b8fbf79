"""The files under deploy/, for the tests that check them: their paths, their YAML, the
compose file's daemons, and the tools (promtool, systemd-analyze, kubectl) run on them."""

from __future__ import annotations

import shlex
import subprocess
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


def deploy_files(*suffixes: str) -> list[Path]:
    """Every file under deploy/ whose name ends in one of ``suffixes``."""
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in suffixes)


def load_yaml(path: Path) -> list:
    """Every document of the YAML file ``path``."""
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def load_compose() -> dict:
    """The compose file."""
    (doc,) = load_yaml(COMPOSE)
    return doc


def service_command(service: dict) -> list[str]:
    """The arguments a compose service passes the image's entry point."""
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else list(command)


def daemon_services(compose: dict) -> list[str]:
    """The compose services that run the daemon (``outboxd run``) from the image."""
    return [
        name
        for name, service in compose["services"].items()
        if "build" in service and service_command(service) == ["run"]
    ]


def run_tool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a checking tool (promtool, systemd-analyze, kubectl), its output captured."""
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd)
