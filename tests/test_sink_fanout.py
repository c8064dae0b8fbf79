"""The sinks' fan-out: a slow, hanging or failing sink loses its own events, counted, and
never holds up another sink or the caller (sinks/fanout.py)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from sinks.attempt import DeliveryAttempt
from sinks.fanout import SinkFanout


def _attempt(n: int) -> DeliveryAttempt:
    return DeliveryAttempt(
        message_id=n, tenant_id="t1", url="https://buyer.example/hook", attempt_number=1, outcome="success",
        http_status_code=200, error_message=None, response_time_ms=3, will_retry=False, next_retry_at=None,
        payload_size_bytes=10, sequence_number=None, idempotency_key=f"whk_{n:032d}", notification_type=None,
        trigger="scheduled", daemon_id="unit", occurred_at=0.0)


class Keeping:
    name = "keeping"

    def __init__(self) -> None:
        self.seen: list[int] = []

    async def record(self, attempt: DeliveryAttempt) -> None:
        self.seen.append(attempt.message_id)


class Hanging:
    name = "hanging"

    async def record(self, attempt: DeliveryAttempt) -> None:
        await asyncio.sleep(3600)


class Failing:
    name = "failing"

    async def record(self, attempt: DeliveryAttempt) -> None:
        raise RuntimeError("a sink's own bug")


async def test_each_sink_gets_every_attempt_in_order_and_a_bad_one_loses_only_its_own():
    errors: Counter[str] = Counter()
    keeping = Keeping()
    fanout = SinkFanout([Hanging(), keeping, Failing()], timeout=0.05, on_error=lambda name: errors.update([name]))
    fanout.start()
    started = time.monotonic()
    for n in range(4):
        fanout.publish(_attempt(n))
    published = time.monotonic() - started
    await asyncio.sleep(0.5)  # four timeouts of 0.05 s each
    await fanout.close(grace=0.1)
    assert published < 0.05  # publishing never waits for a sink
    assert keeping.seen == [0, 1, 2, 3]
    assert errors == {"hanging": 4, "failing": 4}


async def test_close_ends_a_hanging_sink_after_its_grace():
    fanout = SinkFanout([Hanging()], timeout=3600)
    fanout.start()
    fanout.publish(_attempt(1))
    await asyncio.sleep(0)
    started = time.monotonic()
    await fanout.close(grace=0.2)
    assert time.monotonic() - started < 1.0
