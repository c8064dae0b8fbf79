"""The TypeScript AdCP SDK (``@adcp/sdk``, pinned in ``tests/node/package.json``) as a test oracle.

``install`` runs ``npm ci`` once when ``tests/node/node_modules`` is missing; the tests reach
the SDK through ``tests/node/adcp_ts.js``, one node process per batch (its start-up costs
about half a second), so a test pays for node once however many webhooks it verifies.
"""

from __future__ import annotations

import base64
import fcntl
import json
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

NODE_DIR = Path(__file__).resolve().parent / "node"
SCRIPT = NODE_DIR / "adcp_ts.js"
PACKAGE = NODE_DIR / "node_modules" / "@adcp" / "sdk" / "package.json"


@dataclass(frozen=True)
class Captured:
    """One webhook request as a receiver saw it: what a buyer's verifier gets."""

    method: str
    url: str
    headers: Mapping[str, str]
    body: bytes


def install() -> str:
    """The pinned SDK's version, after ``npm ci`` if it is not installed yet; fails the run
    (never skips it) when npm is absent or the install fails."""
    # The suite's workers may all get here at once: one installs, the others wait for it.
    with open(NODE_DIR / "package-lock.json", "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not PACKAGE.is_file():
            npm = shutil.which("npm")
            if npm is None:
                pytest.fail("npm is not installed: the TypeScript @adcp/sdk checks need node and npm (see .ci/run)",
                            pytrace=False)
            done = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True,
                                  text=True, timeout=600)
            if done.returncode != 0:
                pytest.fail(f"npm ci in {NODE_DIR} failed: {done.stderr.strip()[-500:]}", pytrace=False)
    return str(json.loads(PACKAGE.read_text())["version"])


def _call(command: str, payload: Mapping[str, Any], timeout: float) -> Any:
    done = subprocess.run(["node", str(SCRIPT), command], input=json.dumps(payload), cwd=NODE_DIR,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def verify(jwks: Mapping[str, Any], requests: Iterable[Captured]) -> list[dict[str, Any]]:
    """The SDK's ``verifyWebhookSignature`` over each request, one replay store for them all:
    ``{"ok": True, "keyid"}`` or ``{"ok": False, "code", "step", "message"}`` per request."""
    batch = [{"method": r.method, "url": r.url, "headers": dict(r.headers),
              "body_b64": base64.b64encode(r.body).decode("ascii")} for r in requests]
    return list(_call("verify", {"jwks": jwks, "requests": batch}, timeout=120))


STORYBOARD_SECONDS = 600  # a bound on one storyboard run (webhook_emission waits out a 90 s window)


def run_storyboard(agent_url: str, jwks_url: str, storyboard: str,
                   timeout: float = STORYBOARD_SECONDS) -> dict[str, Any]:
    """The SDK's ``runStoryboard`` result for ``storyboard`` of its compliance cache, run over MCP
    with its loopback webhook receiver and its webhook verifier fed from ``jwks_url``."""
    return dict(_call("storyboard", {"agent_url": agent_url, "jwks_url": jwks_url, "storyboard": storyboard},
                      timeout=timeout))


def step_grades(result: Mapping[str, Any]) -> dict[str, str]:
    """``passed``, ``failed`` or ``skipped`` for every step of a storyboard result.

    Graded here, step by step, because the runner's ``overall_passed`` ignores the failures
    of optional phases (the signature phase of ``webhook_emission`` is one) and a skipped step
    reports ``passed`` too.
    """
    grades = {}
    for phase in result["phases"]:
        for step in phase["steps"]:
            grade = "skipped" if step.get("skipped") else "passed" if step.get("passed") else "failed"
            grades[f"{phase['phase_id']}/{step['step_id']}"] = grade
    return grades
