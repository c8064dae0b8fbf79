"""The project explains itself with what it ships: every file it cites is in the repository,
every section of docs/ it cites exists, and every ``outboxd`` command its docs and alert
runbooks tell an operator to type parses with the real argument parser.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from supervisor.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
# A section sign cites a numbered section, so it must say of what: an RFC (the project's own
# documents are cited by heading, "docs/protocol.md, \"Signing\""). A bare section number once meant
# a document that is not in the repository.
SECTION_SIGN = re.compile(r"§\s*\d")
CITED_FILE = re.compile(r"(?<![\w/.:-])((?:[\w.-]+/)*[\w-]+\.(?:md|toml|ya?ml|json|py))\b")
CITED_SECTION = re.compile(r"((?:docs/)?(?:protocol|architecture)\.md),?\s+((?:\"[^\"\n]+\"(?:,\s*|\s+and\s+)?)+)")
DOC_FILES = ("README.md", "docs", "deploy")


def tracked() -> list[str]:
    """The repository's files (committed or about to be), as a clone would have them."""
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return [n for n in names if (ROOT / n).is_file()]


def text_of(name: str) -> str | None:
    try:
        return (ROOT / name).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def test_every_numbered_section_citation_names_its_document():
    offenders = [f"{name}:{n}" for name in tracked()
                 for n, line in enumerate((text_of(name) or "").splitlines(), 1)
                 if SECTION_SIGN.search(line) and "RFC " not in line]
    assert not offenders, f"section citations of no document in the repository (cite docs/ or an RFC): {offenders}"


def test_every_cited_markdown_file_exists():
    files = set(tracked())
    basenames = {Path(f).name for f in files}
    missing = []
    for name in files:
        for line in (text_of(name) or "").splitlines():
            for cited in CITED_FILE.findall(line):
                if not cited.endswith(".md") or "://" in line.split(cited)[0][-12:]:
                    continue
                here = (Path(name).parent / cited).as_posix()
                if cited not in files and here not in files and cited not in basenames:
                    missing.append(f"{name}: {cited}")
    assert not missing, missing


def _headings(doc: str) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+\s+(.+)$", (ROOT / "docs" / doc).read_text(), re.M)}


def test_every_cited_docs_section_exists():
    headings = {d: _headings(d) for d in ("protocol.md", "architecture.md")}
    wrong = []
    for name in tracked():
        for doc, sections in CITED_SECTION.findall(text_of(name) or ""):
            for section in re.findall(r'"([^"]+)"', sections):
                if section not in headings[Path(doc).name]:
                    wrong.append(f"{name}: {doc} {section!r}")
    assert not wrong, wrong


def test_protocol_doc_links_only_to_the_public_spec_pages():
    links = re.findall(r"https?://[^\s)>]+", (ROOT / "docs" / "protocol.md").read_text())
    assert links and all(link.startswith("https://adcontextprotocol.org/docs/") for link in links), links


def _documented_commands() -> list[tuple[str, str]]:
    found = []
    for name in tracked():
        if name == "README.md" or name.startswith(DOC_FILES[1:]):
            text = text_of(name) or ""
            found += [(name, m) for m in re.findall(r"`outboxd ([^`]+)`", text)]
            found += [(name, m) for m in re.findall(r"^ExecStart=\S*/outboxd (.+)$", text, re.M)]
            if name.endswith(".md"):  # command lines in code blocks, without their comments
                found += [(name, m.strip()) for m in re.findall(r"^(?: {4,}|\t)(?:\S*/)?outboxd ([^#\n]+)", text, re.M)]
    return found


def test_the_docs_name_commands_at_all():
    names = {name for name, _ in _documented_commands()}
    assert {"README.md", "deploy/prometheus/alerts.yml"} <= names


@pytest.mark.parametrize("where, command", _documented_commands())
def test_every_documented_command_parses(where, command):
    subcommands = next(a for a in build_parser()._actions if a.dest == "command").choices
    if re.search(r"\[|\|", command):  # a synopsis (`outboxd status | list`, `replay [IDS]`): the names exist
        first_words = [part.split()[0] for part in command.split(" | ")]
        assert set(first_words) <= set(subcommands), f"{where}: {command}"
        return
    concrete = (command.replace("ID|KEY", "1").replace("TENANT@ORIGIN", "acme@https://buyer.example")
                .replace("ID", "1"))
    try:
        build_parser().parse_args(shlex.split(concrete))
    except SystemExit as exc:  # --version and --help exit 0 after printing
        if exc.code == 0:
            return
        pytest.fail(f"{where}: `outboxd {command}` does not parse (exit {exc.code})")
