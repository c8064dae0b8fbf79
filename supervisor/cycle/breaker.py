"""Per-tenant, per-endpoint circuit breakers whose state lives in ``outbox_breakers``.

A breaker judges a failure *rate* over a recent window, not a streak (the model of
Convoy, resilience4j and Polly): it opens when, over the last ``window_seconds``, at least
``failure_threshold`` attempts failed and they are at least ``failure_ratio`` of all
attempts. An endpoint failing everything trips on its ``failure_threshold``-th request; a
buyer failing 30 % of requests at random never does (the ratio of a window of real
traffic does not drift from 0.3 to 0.7).

The window is a two-bucket sliding counter: the current bucket plus the previous one,
weighted by how much of it still overlaps the window, so a window that just rolled over
is not judged on a handful of requests. A bucket starts with its first failure (or with
traffic while the previous bucket still counts), so an endpoint that only succeeds never
writes its row.

After the open period (``open_timeout_seconds``, doubling on each consecutive trip up to
``max_open_timeout_seconds``) the breaker is half-open and admits one probe at a time;
``success_threshold`` probe successes close it (and reset the doubling), a probe failure
re-opens it. These functions are pure; the completer applies them to locked rows once per
batch per key, and records each transition once.
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
    failure_threshold: int = 10  # failed attempts in the window before the ratio is judged
    success_threshold: int = 2  # half-open probe successes that close the breaker
    open_timeout_seconds: float = 30.0
    max_open_timeout_seconds: float = 300.0
    failure_ratio: float = 0.7  # failed share of the window's attempts that trips it
    window_seconds: float = 30.0

    def __post_init__(self) -> None:
        if not 0.0 < self.failure_ratio <= 1.0:
            raise ValueError("failure_ratio must be within (0, 1]")
        if self.window_seconds <= 0 or self.failure_threshold < 1 or self.success_threshold < 1:
            raise ValueError("window_seconds must be > 0, failure and success thresholds >= 1")

    def open_period(self, trips: int) -> float:
        """Open time after the ``trips``-th consecutive trip: 30 s, 60 s, 120 s … capped."""
        return min(self.open_timeout_seconds * 2 ** min(max(trips - 1, 0), 32), self.max_open_timeout_seconds)


WINDOW_COLUMNS = ("window_started_at", "window_attempts", "window_failures", "previous_attempts",
                  "previous_failures")


def closed_row(tenant_id: str, origin: str) -> dict[str, Any]:
    return {"tenant_id": tenant_id, "origin": origin, "state": CircuitState.CLOSED.value, "failures": 0,
            "successes": 0, "trips": 0, "open_until": None, "probe_until": None, "window_started_at": None,
            "window_attempts": 0, "window_failures": 0, "previous_attempts": 0, "previous_failures": 0}


def _roll(state: dict[str, Any], now: float, window: float) -> None:
    """Start a new bucket once the current one is a window old; keep it as the previous one."""
    started = state["window_started_at"]
    if started is None or now - started < window:
        return
    recent = now - started < 2 * window
    state["previous_attempts"] = state["window_attempts"] if recent else 0
    state["previous_failures"] = state["window_failures"] if recent else 0
    state.update(window_started_at=None, window_attempts=0, window_failures=0)


def window_counts(state: Mapping[str, Any], now: float, window: float) -> tuple[float, float]:
    """(attempts, failures) over the last ``window`` seconds, the previous bucket weighted."""
    started = state["window_started_at"]
    weight = 0.0 if started is None else max(0.0, 1.0 - (now - started) / window)
    return (state["window_attempts"] + weight * (state["previous_attempts"] or 0),
            state["window_failures"] + weight * (state["previous_failures"] or 0))


def apply_outcomes(
    row: Mapping[str, Any], successes: Iterable[bool], *, now: float, policy: CircuitBreakerPolicy
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Fold a batch of outcomes (in order) into a breaker row.

    Returns the new row and the transitions made, as (from_state, to_state) pairs. The row
    comes back equal to ``row`` (``updated_at`` included) when nothing changed, so the
    caller writes only what changed.
    """
    state = {**closed_row(row["tenant_id"], row["origin"]), **{k: v for k, v in row.items() if v is not None}}
    for column in ("open_until", "probe_until", "window_started_at"):
        state[column] = row.get(column)
    before = dict(state)
    transitions: list[tuple[str, str]] = []

    def move(to: CircuitState) -> None:
        transitions.append((state["state"], to.value))
        state["state"] = to.value

    def trip(failures: int) -> None:
        """Open it; ``failures`` (what tripped it) stays on the row for operators until it closes."""
        state["trips"] += 1
        state.update(failures=failures, successes=0, probe_until=None,
                     open_until=now + policy.open_period(state["trips"]), window_started_at=None,
                     window_attempts=0, window_failures=0, previous_attempts=0, previous_failures=0)
        move(CircuitState.OPEN)

    for ok in successes:
        current = CircuitState(state["state"])
        if current is CircuitState.CLOSED:
            _roll(state, now, policy.window_seconds)
            if state["window_started_at"] is None:
                if ok and not state["previous_attempts"]:
                    continue  # a healthy endpoint: nothing to remember, nothing to write
                state["window_started_at"] = now
            state["window_attempts"] += 1
            state["window_failures"] += 0 if ok else 1
            state["failures"] = 0 if ok else state["failures"] + 1  # the streak, for operators
            attempts, failures = window_counts(state, now, policy.window_seconds)
            if failures >= policy.failure_threshold and failures >= policy.failure_ratio * attempts:
                trip(round(failures))
        elif current is CircuitState.HALF_OPEN:
            if not ok:
                trip(state["failures"] + 1)  # the failed probe, on top of what tripped it before
                continue
            state["successes"] += 1
            # The next probe may go now: the lease cut short to now, not NULL, which is what the
            # due tables' trigger (migration 0014) watches for to put the endpoint before the claim.
            state["probe_until"] = now
            if state["successes"] >= policy.success_threshold:
                state.update(failures=0, successes=0, trips=0, open_until=None)
                move(CircuitState.CLOSED)
        # OPEN: outcomes of requests sent before the trip change nothing.
    if state != before:
        state["updated_at"] = now
    return state, transitions
