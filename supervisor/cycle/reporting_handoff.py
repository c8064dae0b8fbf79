"""The reporting hand-off inside ``outboxd run`` (``OUTBOX_REPORTING_HANDOFF``, docs/reporting.md).

The seller names a factory, ``package.module:factory``, that builds its
:class:`outbox.reporting.ReportingHandoff` objects (one per SDK queue: the SDK's PostgreSQL
storage keeps status changes in a queue of their own) from outboxd's settings. The daemon then runs a turn
every poll interval next to delivery, so the seller operates no second daemon. A failing
turn is logged and counted and tried again: it never stops delivery of what is committed.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from typing import Any

import structlog

from outbox.config import Settings
from outbox.errors import ConfigurationError
from outbox.reporting import Backlog, ReportingHandoff
from supervisor.observe.metrics import Metrics


async def build_handoffs(settings: Settings) -> tuple[ReportingHandoff, ...]:
    """Call the configured factory (plain or async; one hand-off or several) and check them."""
    path = settings.reporting_handoff or ""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"OUTBOX_REPORTING_HANDOFF {path!r} must be written package.module:factory")
    try:
        # In a thread: importing the SDK's reporting package takes seconds of CPU (ten and
        # more on a busy box), and the daemon is already delivering on this event loop. A
        # stop does not wait for it (``outboxd run`` leaves before the loop joins its threads).
        factory = getattr(await asyncio.to_thread(importlib.import_module, module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"OUTBOX_REPORTING_HANDOFF {path!r} cannot be loaded: {exc}") from None
    try:
        built: Any = factory(settings)
        if inspect.isawaitable(built):
            built = await built
    except Exception as exc:  # the seller's code: one line naming it, not a traceback of it
        first = (str(exc).splitlines() or [""])[0][:300]
        raise ConfigurationError(f"OUTBOX_REPORTING_HANDOFF {path!r} failed: {type(exc).__name__}: {first}") from None
    handoffs = tuple(built) if isinstance(built, (list, tuple)) else (built,)
    if not handoffs or not all(isinstance(h, ReportingHandoff) for h in handoffs):
        raise ConfigurationError(f"OUTBOX_REPORTING_HANDOFF {path!r} returned {type(built).__name__}, not "
                                 "an outbox.reporting.ReportingHandoff (or a non-empty list of them)")
    return handoffs


async def total_backlog(handoffs: tuple[ReportingHandoff, ...]) -> Backlog | None:
    """The SDK work not yet in outboxd, over every queue (``None``: no queue can say)."""
    known = [b for b in [await h.backlog() for h in handoffs] if b is not None]
    if not known:
        return None
    return Backlog(sum(b.expansions for b in known), sum(b.deliveries for b in known),
                   sum(b.quarantined for b in known))


async def handoff_turn(handoffs: tuple[ReportingHandoff, ...], metrics: Metrics) -> None:
    """One turn: expand and hand off what is due in every queue, then sample the backlog.

    A quarantined delivery is never sent, so each is logged with what identifies it (the
    count alone, per process, was the only trace of a cipher key that differed between
    daemons)."""
    log = structlog.get_logger("outboxd.reporting")
    for handoff in handoffs:
        for result in await handoff.run_once():
            metrics.reporting_handoffs.labels(state=result.state).inc()
            if result.state == "quarantined":
                log.warning("reporting.quarantined", tenant_id=handoff.tenant_id, delivery_id=result.delivery_id,
                            idempotency_key=result.idempotency_key, error=result.error,
                            hint="never sent: a delivery sealed under another REPORTING cipher key than this "
                                 "daemon's, or a body outboxd refuses (docs/reporting.md)")
    backlog = await total_backlog(handoffs)
    if backlog is not None:
        metrics.reporting_backlog.labels(queue="expansions").set(backlog.expansions)
        metrics.reporting_backlog.labels(queue="deliveries").set(backlog.deliveries)


async def close_all(handoffs: tuple[ReportingHandoff, ...]) -> None:
    for handoff in handoffs:
        await handoff.aclose()


async def run_handoff(settings: Settings, metrics: Metrics) -> None:
    """The daemon's hand-off task: a turn every ``OUTBOX_POLL_INTERVAL_SECONDS`` until cancelled."""
    log = structlog.get_logger("outboxd.reporting")
    handoffs = await build_handoffs(settings)
    try:
        while True:
            try:
                await handoff_turn(handoffs, metrics)
            except Exception as exc:  # the SDK's store or outboxd's database: the next turn retries
                metrics.reporting_handoff_errors.inc()
                log.warning("reporting.handoff_failed", error=f"{type(exc).__name__}: {exc}"[:300])
            await asyncio.sleep(settings.poll_interval_seconds)
    finally:
        await close_all(handoffs)
