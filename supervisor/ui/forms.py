"""The console's form and query-string fields, read into what the queries take.

Anything typed wrong comes back as :class:`BadInput`, a sentence the page shows as it is:
never a Python exception's text.
"""

from __future__ import annotations

import argparse
from typing import Any

from outbox.schema import DEAD_REASONS, STATES
from supervisor import ops
from supervisor.cli_common import parse_time
from supervisor.ui.present import label

FILTER_FIELDS = ("tenant", "key", "url", "state", "reason", "since", "until")
REPLAY_LIMIT_MAX = 10_000
REPLAY_LIMIT_DEFAULT = 1000


class BadInput(ValueError):
    """A field the user can fix; its text is shown on the page."""


def _choice(value: str | None, allowed: tuple[str, ...], field: str) -> str | None:
    if value and value not in allowed:
        raise BadInput(f"{field} must be one of: {', '.join(label(a) for a in allowed)}.")
    return value


def filters_from(params: Any, limit: int = 100) -> ops.Filters:
    """:class:`ops.Filters` from a query string or form; empty fields are no filter."""
    values = {f: (params.get(f) or "").strip() or None for f in FILTER_FIELDS}
    times = {}
    for name in ("since", "until"):
        try:
            times[name] = parse_time(values[name]) if values[name] else None
        except argparse.ArgumentTypeError:
            raise BadInput(f"{name.capitalize()}: write a time like 2026-12-01T10:00Z, or how long ago, "
                           f"like 30m, 2h or 7d.") from None
    return ops.Filters(state=_choice(values["state"], STATES, "State"),
                       reason=_choice(values["reason"], DEAD_REASONS, "Reason"),
                       tenant=values["tenant"], key=values["key"], url=values["url"],
                       since=times["since"], until=times["until"], limit=limit)


def _whole_number(value: Any, field: str, low: int, high: int) -> int:
    text = str(value).strip()
    if not (text.isascii() and text.isdigit()) or not low <= int(text) <= high:  # "¹".isdigit() is true
        raise BadInput(f"“{field}” must be a whole number from {low:,} to {high:,}.")
    return int(text)


def replay_limit(value: Any) -> int:
    """How many matching messages a replay may take ("at most" on the form)."""
    return REPLAY_LIMIT_DEFAULT if value in (None, "") else _whole_number(value, "at most", 1, REPLAY_LIMIT_MAX)


def page_start(value: str | None) -> int | None:
    """The ``before`` of a page link: a message id, or nothing for the newest page."""
    return None if not value else _whole_number(value, "before", 1, 2**63 - 1)
