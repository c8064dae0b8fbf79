"""How the console words things: readable labels, durations and times relative to now.

Registered as Jinja filters (:func:`install`). Times are relative to the database's clock
(the one every stored time comes from), with the exact UTC time on hover.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from jinja2 import Environment
from markupsafe import Markup, escape

from supervisor.operator.ops import rfc3339

# Words a plain "replace underscores" would get wrong.
LABELS = {
    "tenant_id": "Tenant", "dead_reason": "Dead reason", "idempotency_key": "Idempotency key",
    "url": "URL", "auth_mode": "Signing", "http_status": "HTTP status", "last_status": "Last HTTP status",
    "in_flight": "In flight", "rfc9421": "RFC 9421 signature", "hmac": "HMAC (legacy)", "bearer": "Bearer (legacy)",
    "signature_rejected": "Signature rejected", "proof_failed": "URL proof failed", "half_open": "Half open",
    "connection_error": "Connection error", "circuit_open": "Breaker open", "payload_size": "Payload size",
    "response_time_ms": "Response time", "first_attempt_at": "First claimed", "next_attempt_at": "Next attempt",
    "retry_until": "Retries until", "finished_at": "Finished", "created_at": "Created", "sequence_number": "Sequence",
    "attempts": "Attempts", "trigger": "Trigger", "last_error": "Last error", "subscriber_state": "Subscriber",
}


def label(name: Any) -> str:
    """``signature_rejected`` as "Signature rejected"."""
    text = str(name)
    return LABELS.get(text) or (text[:1].upper() + text[1:]).replace("_", " ")


def duration(seconds: float | None) -> str:
    """A span in the two largest units that matter: "4 min 12 s", "2 h 5 min", "3 d 4 h"."""
    if seconds is None:
        return "–"
    seconds = abs(seconds)
    if seconds < 1:
        return "under 1 s"
    units = (("d", 86400), ("h", 3600), ("min", 60), ("s", 1))
    parts: list[str] = []
    for name, size in units:
        if seconds >= size or parts:
            amount, seconds = divmod(seconds, size)
            parts.append(f"{int(amount)} {name}")
        if len(parts) == 2:
            break
    return " ".join(p for p in parts if not p.startswith("0 ")) or parts[0]


def _epoch(value: Any) -> float | None:
    if value is None or isinstance(value, (int, float)):
        return value
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


def when(value: Any, now: float) -> Markup:
    """A stored time as "5 min ago" / "in 3 h", the exact UTC time on hover; "–" for none."""
    epoch = _epoch(value)
    if epoch is None:
        return Markup("–")
    exact = rfc3339(epoch)
    delta = now - epoch
    words = "just now" if abs(delta) < 1 else (f"{duration(delta)} ago" if delta > 0 else f"in {duration(delta)}")
    return Markup(f'<time datetime="{exact}" title="{exact}">{escape(words)}</time>')


def percent(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio * 100:.1f} %"


def millis(value: float | None) -> str:
    """A response time: "85 ms", "1.25 s"; "–" for none."""
    if value is None:
        return "–"
    return f"{value:.0f} ms" if value < 1000 else f"{value / 1000:.2f} s"


def about(seconds: float) -> str:
    """An estimate of a span: "about 4 min 12 s", or "under 1 s" (never "about under 1 s")."""
    return duration(seconds) if abs(seconds) < 1 else f"about {duration(seconds)}"


def install(env: Environment) -> None:
    env.filters.update(label=label, duration=duration, about=about, when=when, percent=percent, millis=millis)
