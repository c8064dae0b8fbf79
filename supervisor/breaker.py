"""Per-tenant, per-endpoint circuit breakers whose state lives in ``outbox_breakers``.

The state machine is the ``adcp`` SDK's (docs/protocol.md "Circuit breakers": open after 5 consecutive
failures, half-open after 60 s, closed after 2 successes, a half-open failure re-opens),
made durable and shared by every daemon, with two additions: the open period doubles on
each consecutive trip up to a cap, and half-open admits one probe at a time (the claim
query skips a breaker whose probe is in flight). These functions are pure; the completer
applies them to locked rows once per batch per key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any


class CircuitState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class CircuitBreakerPolicy:
    failure_threshold: int = 5
    success_threshold: int = 2
    open_timeout_seconds: float = 60.0
    max_open_timeout_seconds: float = 3600.0

    def open_period(self, trips: int) -> float:
        """Open time after the ``trips``-th consecutive trip: 60 s, 120 s, 240 s … capped."""
        return min(self.open_timeout_seconds * 2 ** max(trips - 1, 0), self.max_open_timeout_seconds)


def closed_row(tenant_id: str, origin: str) -> dict[str, Any]:
    return {"tenant_id": tenant_id, "origin": origin, "state": CircuitState.CLOSED.value, "failures": 0,
            "successes": 0, "trips": 0, "open_until": None, "probe_until": None}


def apply_outcomes(
    row: Mapping[str, Any], successes: Iterable[bool], *, now: float, policy: CircuitBreakerPolicy
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Fold a batch of outcomes (in order) into a breaker row.

    Returns the new row and the transitions made, as (from_state, to_state) pairs.
    """
    state = dict(row)
    transitions: list[tuple[str, str]] = []

    def move(to: CircuitState) -> None:
        transitions.append((state["state"], to.value))
        state["state"] = to.value

    def trip() -> None:
        state["trips"] += 1
        state.update(failures=0, successes=0, probe_until=None,
                     open_until=now + policy.open_period(state["trips"]))
        move(CircuitState.OPEN)

    for ok in successes:
        current = CircuitState(state["state"])
        if current is CircuitState.CLOSED:
            state["failures"] = 0 if ok else state["failures"] + 1
            if state["failures"] >= policy.failure_threshold:
                trip()
        elif current is CircuitState.HALF_OPEN:
            if not ok:
                trip()
                continue
            state["successes"] += 1
            state["probe_until"] = None  # the next probe may go
            if state["successes"] >= policy.success_threshold:
                state.update(failures=0, successes=0, trips=0, open_until=None)
                move(CircuitState.CLOSED)
        # OPEN: outcomes of requests sent before the trip change nothing.
    state["updated_at"] = now
    return state, transitions
