"""Validate bodies against the AdCP JSON schemas the ``adcp`` package ships."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import adcp
from jsonschema import Draft7Validator
from referencing import Registry, Resource

SCHEMA_ROOT = Path(adcp.__file__).parent / "_schemas" / "3.2"
_PREFIX = "https://adcontextprotocol.org/schemas/"


def _retrieve(uri: str) -> Resource:
    relative = uri.removeprefix(_PREFIX).split("/", 1)[1]  # drop the version segment
    return Resource.from_contents(json.loads((SCHEMA_ROOT / relative).read_text()))


@lru_cache
def validator(name: str = "core/mcp-webhook-payload.json") -> Draft7Validator:
    schema = json.loads((SCHEMA_ROOT / name).read_text())
    return Draft7Validator(schema, registry=Registry(retrieve=_retrieve))


def assert_valid(body: bytes, name: str = "core/mcp-webhook-payload.json") -> None:
    errors = sorted(validator(name).iter_errors(json.loads(body)), key=str)
    assert not errors, "\n".join(e.message for e in errors[:5])
