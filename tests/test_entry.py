"""``outboxd`` refuses, in one line, a ``supervisor`` package that is not outboxd's.

supervisord's PyPI package is also imported as ``supervisor``. Each test puts a stand-in
for it earlier on ``sys.path`` of a real ``outboxd`` process, the way a second install
or a checkout would.
"""

from __future__ import annotations

import base64

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_outboxd(cwd: Path, *args: str, path_first: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``outboxd ARGS`` from ``cwd`` (``-m`` puts it first on ``sys.path``), this tree next."""
    paths = ([str(path_first)] if path_first else []) + [str(ROOT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    env = {k: v for k, v in env.items() if not k.startswith("OUTBOX_")}
    return subprocess.run([sys.executable, "-m", "outbox.entry", *args], env=env, capture_output=True,
                          text=True, timeout=60, cwd=cwd)


def fake_supervisord(directory: Path) -> Path:
    package = directory / "supervisor"
    package.mkdir()
    (package / "__init__.py").write_text("# supervisord's package: supervisord.py, supervisorctl.py, ...\n")
    (package / "supervisord.py").write_text("")
    return package


def test_a_foreign_supervisor_package_stops_outboxd_with_one_actionable_line(tmp_path):
    (tmp_path / "site").mkdir()
    package = fake_supervisord(tmp_path / "site")
    result = run_outboxd(tmp_path, "status", path_first=tmp_path / "site")
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert str(package / "__init__.py") in lines[0]
    assert "is not outboxd's" in lines[0] and "supervisord" in lines[0] and "virtualenv" in lines[0]


def test_outboxd_runs_its_cli_when_supervisor_is_its_own(tmp_path):
    result = run_outboxd(tmp_path, "--help")
    assert result.returncode == 0 and "migrate" in result.stdout, result.stderr
    generated = run_outboxd(tmp_path, "encryption", "generate")  # a subcommand runs, database or not
    assert generated.returncode == 0 and len(base64.b64decode(generated.stdout.strip())) == 32
