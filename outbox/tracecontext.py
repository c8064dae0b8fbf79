"""The caller's W3C trace context (``traceparent``), recorded with a message at enqueue.

The daemon makes each attempt's span a child of it, so a seller's trace runs from the
request that changed a task, through the enqueue in its transaction, to every attempt and
the buyer's answer (docs/observability.md, "Traces"). It is transport, not content: it is
not part of the idempotency binding, so a retried enqueue from another trace finds its
record. Free for an application that does not use OpenTelemetry: nothing is imported
unless the application already imported ``opentelemetry.trace`` itself.
"""

from __future__ import annotations

import sys


def current_traceparent() -> str | None:
    """The ``traceparent`` of the active span (``None``: no OpenTelemetry, or no valid span)."""
    if "opentelemetry.trace" not in sys.modules:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)  # the current context; nothing when no valid span
    return carrier.get("traceparent")
