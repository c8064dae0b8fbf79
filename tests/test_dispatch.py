"""supervisor.cycle.dispatch.Dispatcher: per-origin slots and the queue of messages waiting for one."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from outbox.leases import Claimed
from supervisor.cycle.dispatch import Dispatcher

PROTO = Claimed(id=0, tenant_id="t", url="https://a.example/", origin="https://a.example", idempotency_key="k",
                body=b"{}", body_sha256=None, auth_mode="rfc9421", auth_secret=None, sequence_number=None,
                notification_type=None, attempt=1, retry_until=0.0, created_at=0.0, trigger="scheduled",
                claimed_at=0.0, lease_token="x", claim_sent=0.0)


def msg(i: int, origin: str = "https://a.example", tenant: str = "t") -> Claimed:
    return replace(PROTO, id=i, origin=origin, tenant_id=tenant)


class Harness:
    def __init__(self, *, concurrency: int = 64, cap: int = 2, lease: float = 30.0, attempt: float = 20.0) -> None:
        self.now = 0.0
        self.started: list[int] = []
        self.released: list[int] = []
        self.d = Dispatcher(concurrency=concurrency, endpoint_concurrency=cap, lease_seconds=lease,
                            attempt_seconds=attempt, start=lambda m: self.started.append(m.id),
                            release=lambda m: self.released.append(m.id), clock=lambda: self.now)

    def add(self, message: Claimed, *, round_trip: float = 0.0) -> None:
        """``message`` leased by a claim sent ``round_trip`` seconds ago."""
        self.d.add(replace(message, claim_sent=self.now - round_trip))


def test_a_freed_slot_starts_the_next_waiting_message_of_its_origin_at_once() -> None:
    h = Harness(cap=2)
    for i in range(5):
        h.add(msg(i))
    assert h.started == [0, 1] and h.d.waiting("https://a.example") == 3
    h.d.ended(msg(0), holds_slot=False)
    assert h.started == [0, 1, 2], "oldest waiting first, no claim in between"


def test_a_retryable_failure_keeps_its_slot_until_the_breaker_judged_it() -> None:
    h = Harness(cap=1)
    h.add(msg(0))
    h.add(msg(1))
    h.d.ended(msg(0), holds_slot=True)
    assert h.started == [0], "a failing endpoint gets nothing more until its failure is recorded"
    h.d.settled([msg(0)])
    assert h.started == [0, 1]


def test_a_tripped_endpoint_gets_what_waits_for_it_back_unsent_other_tenants_keep_theirs() -> None:
    h = Harness(cap=1)
    h.add(msg(0, tenant="bad"))
    h.add(msg(1, tenant="bad"))
    h.add(msg(2, tenant="good"))
    h.d.ended(msg(0, tenant="bad"), holds_slot=True)
    h.d.tripped([("bad", "https://a.example")])
    assert h.released == [1]
    h.d.settled([msg(0, tenant="bad")])
    assert h.started == [0, 2]


def test_a_message_that_waited_too_long_for_its_lease_goes_back_unsent() -> None:
    h = Harness(cap=1, lease=30.0, attempt=20.0)  # may wait 9 s: its attempt must end 1 s before the lease
    h.add(msg(0))
    h.add(msg(1))
    h.add(msg(2))
    h.now = 9.5
    h.d.ended(msg(0), holds_slot=False)
    assert h.released == [1, 2] and h.started == [0]
    h.add(msg(3))  # a fresh lease with a free slot starts at once
    assert h.started == [0, 3]


def test_a_lease_is_aged_from_when_its_claim_was_sent_not_from_when_the_answer_came() -> None:
    """A claim whose round trip (or SQLite's wait for the write lock) took 9.5 s leased its
    messages 9.5 s before they reach the dispatcher: none may start an attempt that would end
    within a second of its lease."""
    h = Harness(cap=1, lease=30.0, attempt=20.0)
    h.add(msg(0), round_trip=9.5)
    h.add(msg(1), round_trip=0.2)
    assert h.released == [0] and h.started == [1]


def test_a_short_lease_still_sends_what_it_can_start_at_once() -> None:
    h = Harness(cap=1, lease=5.0, attempt=4.0)  # 1 s to spare: the margin halves, never to nothing
    h.add(msg(0))
    h.add(msg(1))
    h.now = 0.4
    h.d.ended(msg(0), holds_slot=False)
    assert h.started == [0, 1] and h.released == []


def test_the_process_cap_spans_origins() -> None:
    h = Harness(concurrency=2, cap=2)
    h.add(msg(0, "https://a.example"))
    h.add(msg(1, "https://a.example"))
    h.add(msg(2, "https://b.example"))
    assert h.started == [0, 1]
    h.d.ended(msg(0, "https://a.example"), holds_slot=False)
    assert h.started == [0, 1, 2], "a slot freed by one origin serves another's waiting message"


def test_release_all_hands_back_every_waiting_message() -> None:
    h = Harness(cap=1)
    for i in range(3):
        h.add(msg(i))
    h.d.release_all()
    assert h.released == [1, 2] and h.d.queued == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "end", "fail", "settle", "trip", "tick"]), st.integers(0, 2)),
                max_size=80))
def test_caps_hold_and_every_message_is_accounted_for(ops: list[tuple[str, int]]) -> None:
    """Whatever happens: never more than the caps taken, never a message waiting while its
    origin and the process have room, and each message started, released or still waiting,
    exactly once."""
    origins = ["https://a.example", "https://b.example", "https://c.example"]
    now = [0.0]
    running: list[Claimed] = []  # requests open
    judged: list[Claimed] = []  # ended in a retryable failure, not yet settled: still hold a slot
    started: list[int] = []
    released: list[int] = []

    def start(m: Claimed) -> None:
        started.append(m.id)
        running.append(m)

    d = Dispatcher(concurrency=3, endpoint_concurrency=2, lease_seconds=30.0, attempt_seconds=20.0, start=start,
                   release=lambda m: released.append(m.id), clock=lambda: now[0])
    added = 0
    for op, k in ops:
        if op == "add":
            d.add(replace(msg(added, origins[k], tenant=f"t{k}"), claim_sent=now[0]))
            added += 1
        elif op in ("end", "fail") and running:
            m = running.pop(0)
            if op == "fail":
                judged.append(m)
            d.ended(m, holds_slot=op == "fail")
        elif op == "settle" and judged:
            d.settled([judged.pop(0)])
        elif op == "trip":
            d.tripped([(f"t{k}", origins[k])])
        elif op == "tick":
            now[0] += 4.0
        taken: dict[str, int] = {}
        for m in running + judged:
            taken[m.origin or ""] = taken.get(m.origin or "", 0) + 1
        assert len(running) <= 3 and d.running == len(running)
        assert all(n <= 2 for n in taken.values()), taken
        for origin in origins:  # and nothing waits while its origin and the process have room
            assert not d.waiting(origin) or taken.get(origin, 0) == 2 or len(running) == 3, (origin, taken)
    assert len(started) + len(released) + d.queued == added
    assert len(set(started) | set(released)) == len(started) + len(released)
