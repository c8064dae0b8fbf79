"""A breaker's move, recorded once: its row in ``outbox_breaker_transitions`` in the
transaction that makes it, then, once that transaction has committed, its count
(``outbox_breaker_transitions_total``) and its ``breaker.transition`` log line
(docs/operations.md, "Clocks, logs and metrics").

The completer moves breakers on the outcomes it records; the claimer moves one from open to
half-open as it takes the probe. Both make the row with :func:`move`, write it with
:func:`outbox.breaker_rows.insert_transitions` and, after the commit, :func:`announce` it, so
a move is written, counted and logged alike, and never counted or logged for a transaction
that rolled back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from supervisor.observe.metrics import Metrics


def move(tenant_id: str, origin: str, before: str, after: str, *, open_until: float | None, daemon_id: str,
         now: float, window_attempts: float | None = None, window_failures: float | None = None) -> dict[str, Any]:
    """The transition row of one move (the window's counts when a request outcome made it)."""
    return {"tenant_id": tenant_id, "origin": origin, "from_state": before, "to_state": after,
            "window_attempts": window_attempts, "window_failures": window_failures, "open_until": open_until,
            "daemon_id": daemon_id, "occurred_at": now}


def announce(moves: Iterable[Mapping[str, Any]], metrics: Metrics, log: Any) -> None:
    """After the commit that recorded them: count each move and log it, once."""
    for m in moves:
        metrics.breaker_transitions.labels(from_state=m["from_state"], to_state=m["to_state"]).inc()
        log.warning("breaker.transition", tenant_id=m["tenant_id"], origin=m["origin"], from_state=m["from_state"],
                    to_state=m["to_state"], open_until=m["open_until"])
