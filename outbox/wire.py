"""The caller's input as JSON: ``adcp`` SDK models converted the way the SDK serializes them.

Shared by the producer (rendering the body) and :mod:`outbox.identity` (the binding
digest), so both see an SDK model exactly as the receiver will.
"""

from __future__ import annotations

from typing import Any


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
