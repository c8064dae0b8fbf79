"""The front page and what a fresh clone meets first: two commands that work as written (CI
runs the same line), a README short enough to read, one answer for the retry horizon, a
license and a changelog matching the version, and text about the product, not its making.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from outbox import store
from tests.pgserver import run_as_postgres

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Development history has no place in what ships: tracker numbers, work sessions, work stops.
HISTORY = re.compile(r"\bissues?[ -]?#?\d+|\b(?:this|earlier|previous|other) sessions?\b|\bstop \d+\b", re.I)


def quick_start_commands() -> list[str]:
    section = README[README.index("## Quick start"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"^ {4}(\S.*)$", section, re.M)


def test_the_two_quick_start_commands_install_what_was_tested():
    demo, suite = quick_start_commands()
    for command in (demo, suite):
        assert "pip install -c deploy/constraints.txt -e " in command, command
    assert demo.endswith("&& outboxd demo") and suite.endswith("&& pytest -q")


def test_ci_runs_the_readme_test_command_as_written():
    _, suite = quick_start_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line for line in ci.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-1] == suite  # the last thing CI does, verbatim
    assert "pytest" not in "\n".join(commands[:-1])


def test_the_readme_is_a_front_page():
    front = README[:README.index("## Operator notes")]
    assert len(front.splitlines()) <= 160
    assert len(README.splitlines()) <= 260  # with the short operator notes after it
    for heading in ("## Quick start", "## Adopting it in an existing seller", "## Enqueue", "## Where to read next"):
        assert f"\n{heading}\n" in README, heading
    checklist = README[README.index("## Adopting it"):README.index("## Enqueue")]
    assert re.findall(r"^(\d)\. \*\*", checklist, re.M) == ["1", "2", "3", "4", "5"]
    for page in re.findall(r"\]\((docs/[\w.]+\.md)\)", README):
        assert (ROOT / page).is_file(), page


def test_nothing_that_ships_tells_the_history_of_its_making():
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    offenders = []
    for name in names:
        path = ROOT / name
        if name == "LICENSE" or not path.is_file() or path.suffix not in (".py", ".md", ".yml", ".yaml", ".toml",
                                                                           ".html", ".txt", ".service", ""):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        offenders += [f"{name}:{n}: {m.group(0)}" for n, line in enumerate(text.splitlines(), 1)
                      for m in [HISTORY.search(line)] if m]
    assert not offenders, offenders


def test_one_answer_for_the_retry_horizon_measured_from_enqueue():
    assert "created_at + COALESCE(horizon_seconds" in store.DEADLINE  # what the code measures from
    protocol = (ROOT / "docs" / "protocol.md").read_text()
    horizon = protocol[
        protocol.index("## Retry horizon"):protocol.index("\n## ", protocol.index("## Retry horizon") + 1)]
    assert "since it was enqueued" in horizon and "first attempt" not in horizon
    assert "past enqueue + horizon" in (ROOT / "docs" / "architecture.md").read_text()
    assert "after it was **enqueued**" in README
    for page in ("README.md", "docs/protocol.md", "docs/architecture.md", "docs/configuration.md"):
        assert "first attempt + horizon" not in (ROOT / page).read_text(), page


def test_license_and_changelog_match_the_project():
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200] and PROJECT["license"]["text"] == "Apache-2.0"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "keepachangelog.com" in changelog
    versions = re.findall(r"^## \[([^\]]+)\]", changelog, re.M)
    assert versions and versions[0] in (PROJECT["version"], "Unreleased")
    assert PROJECT["version"] in versions


@pytest.mark.skipif(os.geteuid() != 0, reason="only root starts PostgreSQL through runuser")
def test_runuser_is_found_without_sbin_on_path(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/local/bin:/usr/bin:/bin")
    prefix = run_as_postgres()
    assert Path(prefix[0]).name == "runuser" and os.access(prefix[0], os.X_OK)
    assert shutil.which("runuser") in (None, prefix[0])
