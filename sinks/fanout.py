"""Hand each attempt to every configured sink without ever slowing delivery.

Attempts go into a bounded queue drained by one task per sink; each ``record`` call has a
timeout. A slow or failing sink loses its own events (counted in
``outbox_sink_errors_total``), never a delivery: the attempt is already committed to the
database by the time a sink sees it.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from sinks.attempt import DeliveryAttempt, DeliveryLogSink

QUEUE_SIZE = 10_000


def resolve(path: str, what: str = "sink") -> Any:
    """The object named ``package.module:Name`` (or ``package.module.Name``)."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} {path!r} must be written package.module:Name")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {path!r} cannot be loaded: {exc}") from None


def load_sink(path: str) -> DeliveryLogSink:
    """Instantiate a sink named ``package.module:Name`` (or ``package.module.Name``)."""
    target = resolve(path)
    sink = target() if isinstance(target, type) else target  # a class, or a ready instance
    if not isinstance(sink, DeliveryLogSink):
        raise ValueError(f"sink {path!r} has no async record(attempt) method")
    return sink


class SinkFanout:
    """Bounded, non-blocking delivery of attempts to sinks."""

    def __init__(self, sinks: Sequence[DeliveryLogSink], *, timeout: float,
                 on_error: Callable[[str], None] = lambda name: None) -> None:
        self._sinks = list(sinks)
        self._timeout = timeout
        self._on_error = on_error
        self._queues: list[asyncio.Queue[DeliveryAttempt]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._log = structlog.get_logger("outboxd.sinks")

    def start(self) -> None:
        for sink in self._sinks:
            queue: asyncio.Queue[DeliveryAttempt] = asyncio.Queue(QUEUE_SIZE)
            self._queues.append(queue)
            self._tasks.append(asyncio.create_task(self._drain(sink, queue), name=f"sink:{_name(sink)}"))

    def publish(self, attempt: DeliveryAttempt) -> None:
        for sink, queue in zip(self._sinks, self._queues):
            try:
                queue.put_nowait(attempt)
            except asyncio.QueueFull:
                self._on_error(_name(sink))

    async def _drain(self, sink: DeliveryLogSink, queue: asyncio.Queue[DeliveryAttempt]) -> None:
        while True:
            attempt = await queue.get()
            try:
                # A timeout in place rather than ``wait_for``, which wraps every record in a
                # task of its own: 5.3 against 8.4 µs per attempt under uvloop.
                async with asyncio.timeout(self._timeout):
                    await sink.record(attempt)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a sink's bug must not stop the daemon
                self._on_error(_name(sink))
                self._log.warning("sink.error", sink=_name(sink), error=type(exc).__name__)
            finally:
                queue.task_done()

    async def close(self, grace: float = 2.0) -> None:
        """Give sinks a moment to drain, then stop them."""
        try:
            await asyncio.wait_for(asyncio.gather(*(q.join() for q in self._queues)), grace)
        except asyncio.TimeoutError:
            pass
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _name(sink: DeliveryLogSink) -> str:
    return getattr(sink, "name", type(sink).__name__)
