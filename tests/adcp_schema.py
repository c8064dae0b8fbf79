"""Validate bodies against the AdCP JSON schemas the ``adcp`` package ships."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import adcp
from jsonschema import Draft7Validator
from referencing import Registry, Resource

SCHEMAS = Path(adcp.__file__).parent / "_schemas"
_VERSIONED = re.compile(r"^(?:https://adcontextprotocol\.org)?/schemas/[^/]+/")


@lru_cache
def validator(name: str = "core/mcp-webhook-payload.json", release: str = "3.2") -> Draft7Validator:
    """A validator of ``name`` in the schemas of AdCP ``release`` (3.2 unless a buyer's is older)."""
    root = SCHEMAS / release

    def retrieve(uri: str) -> Resource:
        relative = _VERSIONED.sub("", uri)  # 3.2 refs are absolute, 3.0 ones "/schemas/3.0.18/..."
        return Resource.from_contents(json.loads((root / relative).read_text()))

    schema = json.loads((root / name).read_text())
    return Draft7Validator(schema, registry=Registry(retrieve=retrieve))


def version_envelope() -> dict[str, Any]:
    """The AdCP 3.2 version-negotiation fields (``adcp_version``, ``adcp_major_version``)."""
    return dict(json.loads((SCHEMAS / "3.2" / "core" / "version-envelope.json").read_text()))


def assert_valid(body: bytes, name: str = "core/mcp-webhook-payload.json", release: str = "3.2") -> None:
    errors = sorted(validator(name, release).iter_errors(json.loads(body)), key=str)
    assert not errors, "\n".join(e.message for e in errors[:5])
