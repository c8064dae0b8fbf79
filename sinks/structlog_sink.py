"""Every attempt as one structured log event (JSON lines by default)."""

from __future__ import annotations

import structlog

from sinks.attempt import DeliveryAttempt


class StructlogSink:
    """Logs ``delivery.attempt`` with the attempt's fields; nothing secret is in them."""

    name = "structlog"

    def __init__(self) -> None:
        self._log = structlog.get_logger("outboxd.attempts")

    async def record(self, attempt: DeliveryAttempt) -> None:
        level = "info" if attempt.outcome == "success" else "warning"
        getattr(self._log, level)("delivery.attempt", **attempt.as_dict())
