"""The caller's input as JSON: ``adcp`` SDK models converted the way the SDK serializes them,
and what JSON a body may hold.

Shared by the producer (rendering the body) and :mod:`outbox.identity` (the binding
digest), so both see an SDK model exactly as the receiver will.
"""

from __future__ import annotations

import math
from typing import Any

# Deepest nesting of objects and arrays a body may have: .NET's System.Text.Json refuses
# deeper documents by default, and a JSON parser's recursion limit is reached long before
# anything a notification needs (docs/enqueue.md, "From Python, inside your transaction").
MAX_JSON_DEPTH = 64
_SCALARS = (str, int, bool, type(None))
_PLAIN = frozenset(_SCALARS)


def wire_form(value: Any) -> Any:
    """An ``adcp`` SDK (pydantic) model as the JSON it puts on the wire; anything else as is.

    The one conversion for SDK models, wherever they appear: a whole argument
    (``push_notification_config``, ``context``, ``payload``, ``result``) or a value nested
    inside a plain mapping (through :func:`json_default`, the ``default`` hook of every
    ``json.dumps`` of caller input, which costs nothing for plain input). JSON mode with
    ``None`` fields left out, as the SDK's own server serializes a tool result
    (``adcp.server.mcp_tools``), and wire names (``by_alias``).
    """
    dump = getattr(value, "model_dump", None)
    return dump(mode="json", by_alias=True, exclude_none=True) if callable(dump) else value


def json_default(value: Any) -> Any:
    """``json.dumps``' ``default``: an SDK model nested in plain input as its wire JSON."""
    converted = wire_form(value)
    if converted is value:
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
    return converted


def json_problem(value: Any) -> tuple[str, str] | None:
    """Where and why ``value`` is not a JSON document a receiver can take, or ``None``.

    ``json.dumps`` alone turns non-string keys into strings (so ``{1: "a", "1": "b"}``
    renders a duplicate key, which the daemon refuses to send) or fails on a mix of them
    with an untyped ``TypeError``, and recurses until the interpreter's limit. This check
    runs before it: object keys are strings, nesting is at most :data:`MAX_JSON_DEPTH`,
    leaves are JSON scalars or ``adcp`` SDK models (rendered by :func:`json_default`), floats are
    finite. The path is dotted from the top (``result.packages[2].budget``).
    """
    problem = _item_problem(value, -1)
    if problem is None:
        return None
    path, reason = problem
    return "".join(reversed(path)).lstrip("."), reason


def _problem(value: Any, depth: int) -> tuple[list[str], str] | None:
    """The problem in ``value`` (a dict, list or tuple at ``depth``), its path reversed."""
    if depth == MAX_JSON_DEPTH:
        return [], f"nests deeper than {MAX_JSON_DEPTH} objects and arrays"
    is_object = isinstance(value, dict)
    for key, item in value.items() if is_object else enumerate(value):
        if is_object and type(key) is not str and not isinstance(key, str):
            return [], f"has the {type(key).__name__} key {key!r}: object keys must be strings"
        kind = type(item)
        if kind in _PLAIN or (kind is float and math.isfinite(item)):
            continue  # the common leaves, by exact type: no isinstance chain
        problem = _item_problem(item, depth)
        if problem is not None:
            problem[0].append(f".{key}" if is_object else f"[{key}]")
            return problem
    return None


def _item_problem(item: Any, depth: int) -> tuple[list[str], str] | None:
    if isinstance(item, (dict, list, tuple)):
        return _problem(item, depth + 1)
    if isinstance(item, float):
        return None if math.isfinite(item) else ([], f"{item} is not a JSON number")
    if isinstance(item, _SCALARS) or callable(getattr(item, "model_dump", None)):
        return None
    return [], f"{type(item).__name__!r} is not a JSON type (convert it to a string or number first)"
