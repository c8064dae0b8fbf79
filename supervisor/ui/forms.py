"""The console's form and query-string fields, read into what the queries take.

Anything typed wrong comes back as :class:`BadInput`, a sentence the page shows as it is:
never a Python exception's text.
"""

from __future__ import annotations

import argparse
from typing import Any

from outbox.schema import DEAD_REASONS, STATES
from supervisor.operator import jobs, ops
from supervisor.cli.common import endpoint_origin_arg, parse_time
from supervisor.ui.present import label

FILTER_FIELDS = ("tenant", "key", "url", "origin", "state", "reason", "since", "until")
REPLAY_LIMIT_MAX = 10_000
REPLAY_LIMIT_DEFAULT = 1000
JOB_RATE_MAX = jobs.MAX_RATE  # as `outboxd recover start --rate`
JOB_RATE_DEFAULT = jobs.DEFAULT_RATE
# The endpoint health windows the console offers (the rollup keeps a day: supervisor/observe/health_stats.py).
HEALTH_WINDOWS = {"15m": 900, "1h": 3600, "24h": 86_400}


class BadInput(ValueError):
    """A field the user can fix; its text is shown on the page."""


def _choice(value: str | None, allowed: tuple[str, ...], field: str) -> str | None:
    if value and value not in allowed:
        raise BadInput(f"{field} must be one of: {', '.join(label(a) for a in allowed)}.")
    return value


def _time(value: str, field: str) -> float:
    """A typed time (ISO, or how long ago), as ``outboxd`` takes it."""
    try:
        return parse_time(value)
    except argparse.ArgumentTypeError:
        raise BadInput(f"{field}: write a time like 2026-12-01T10:00Z, or how long ago, "
                       f"like 30m, 2h or 7d.") from None


def _origin(value: str | None) -> str | None:
    """A typed endpoint, any URL of it, as the origin the daemon records (``--origin`` alike)."""
    try:
        return endpoint_origin_arg(value) if value else None
    except argparse.ArgumentTypeError:
        raise BadInput("Origin: write the endpoint's URL, like https://buyer.example.com.") from None


# Fields taken exactly as typed: a tenant id may begin or end with a space the producer took,
# and trimming it would select another tenant's messages.
_EXACT = frozenset({"tenant"})


def _fields(params: Any, names: tuple[str, ...]) -> dict[str, str | None]:
    """The named fields, empty ones ``None``; trimmed, except those of :data:`_EXACT`."""
    values = {f: params.get(f) or "" for f in names}
    return {f: (v if f in _EXACT else v.strip()) or None for f, v in values.items()}


def filters_from(params: Any, limit: int = 100) -> ops.Filters:
    """:class:`ops.Filters` from a query string or form; empty fields are no filter."""
    values = _fields(params, FILTER_FIELDS)
    times = {name: _time(v, name.capitalize()) if (v := values[name]) else None for name in ("since", "until")}
    return ops.Filters(state=_choice(values["state"], STATES, "State"),
                       reason=_choice(values["reason"], DEAD_REASONS, "Reason"),
                       tenant=values["tenant"], key=values["key"], url=values["url"], origin=_origin(values["origin"]),
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


def job_selection(params: Any) -> jobs.Selection:
    """What a recovery job takes, from its start form: a replay needs a tenant and a time;
    a cancel of pending messages a tenant, its enqueue-time range being optional."""
    values = _fields(params, ("tenant", "since", "until", "origin", "reason", "kind"))
    tenant, since, origin = values["tenant"], values["since"], _origin(values["origin"])
    if values["kind"] == "cancel":
        if not tenant:
            raise BadInput("Cancelling pending messages needs a tenant.")
        start = _time(since, "Enqueued since") if since else 0.0
        end = _time(until, "Enqueued until") if (until := values["until"]) else None
        if end is not None and end < start:
            raise BadInput("“Enqueued until” is before “Enqueued since”.")
        return jobs.Selection(tenant, start, origin, kind="cancel", until=end)
    if values["kind"] not in (None, "replay"):
        raise BadInput("A recovery job either replays dead messages or cancels pending ones.")
    if not tenant or not since:
        raise BadInput("A recovery job needs a tenant and a time its dead messages ended since.")
    return jobs.Selection(tenant, _time(since, "Since"), origin,
                          _choice(values["reason"], DEAD_REASONS, "Reason"))


def job_rate(value: Any) -> float:
    """How many messages a second a recovery job may handle at most ("at most … a second"),
    read as ``outboxd recover start --rate`` reads it."""
    if value in (None, ""):
        return float(JOB_RATE_DEFAULT)
    try:
        return jobs.parse_rate(value)
    except ValueError as exc:
        raise BadInput(f"“messages a second” {exc}.") from None


def health_window(value: str | None) -> tuple[str, int]:
    """The endpoint health window asked for (``?window=``): its name and seconds; an hour by default."""
    name = value or "1h"
    if name not in HEALTH_WINDOWS:
        raise BadInput(f"The health window must be one of: {', '.join(HEALTH_WINDOWS)}.")
    return name, HEALTH_WINDOWS[name]
