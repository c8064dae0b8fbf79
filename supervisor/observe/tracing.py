"""OpenTelemetry traces of the daemon: a span per attempt, per claim and per flush.

Each attempt's span is a child of the trace context recorded at enqueue
(:mod:`outbox.tracecontext`), so it sits in the seller's own trace under the request that
created the webhook; its ids go into the attempt row and the attempt's log line.

Off unless configured the standard way (docs/observability.md, "Traces"): the ``[otel]``
extra installed and an ``OTEL_EXPORTER_OTLP_*ENDPOINT`` or ``OTEL_TRACES_EXPORTER`` in the
environment, or, for a daemon embedded in an application, the application's own
``TracerProvider`` already set. Off, nothing here imports ``opentelemetry``: the claim and
the flush pay one ``None`` check, and the attempt is not wrapped at all.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, ContextManager

from outbox.errors import ConfigurationError
from outbox.leases import Claimed
from outbox.urls import public_url

if TYPE_CHECKING:  # the cycle imports this module: the attempt's types only for annotations
    from supervisor.cycle.attempt import Outcome

    Attempt = Callable[[Claimed], Awaitable[Outcome]]
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER")
DEFAULT_SERVICE_NAME = "outboxd"

_active: "Tracing | None" = None


def requested(env: Mapping[str, str]) -> bool:
    """Whether the environment asks for traces (the OpenTelemetry SDK's own variables)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return any(env.get(name, "").strip() for name in ENDPOINT_VARIABLES)


class Tracing:
    """The daemon's tracer, and the provider to flush at shutdown when the daemon made it."""

    def __init__(self, tracer: Any, provider: Any | None) -> None:
        from opentelemetry.trace import SpanKind, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = tracer
        self._provider = provider
        self._propagator = TraceContextTextMapPropagator()
        self._client, self._error = SpanKind.CLIENT, StatusCode.ERROR

    def traced(self, run: Attempt) -> Attempt:
        """``run`` inside a span per attempt, the child of the message's recorded context."""

        async def attempt(message: Claimed) -> Outcome:
            parent = self._propagator.extract({"traceparent": message.traceparent}) if message.traceparent else None
            attributes = {
                "http.request.method": "POST", "url.full": public_url(message.url),
                "outboxd.tenant_id": message.tenant_id, "outboxd.idempotency_key": message.idempotency_key,
                "outboxd.attempt": message.attempt, "outboxd.message_id": message.id,
            }
            with self._tracer.start_as_current_span("POST", context=parent, kind=self._client,
                                                    attributes=attributes) as span:
                outcome = await run(message)
                span.set_attribute("outboxd.outcome", outcome.outcome)
                span.set_attribute("outboxd.action", outcome.action)
                if outcome.http_status is not None:
                    span.set_attribute("http.response.status_code", outcome.http_status)
                if outcome.outcome != "success":
                    span.set_status(self._error, outcome.error or outcome.outcome)
                ids = span.get_span_context()
            return dataclasses.replace(outcome, trace=(f"{ids.trace_id:032x}", f"{ids.span_id:016x}"))

        return attempt

    @contextmanager
    def span(self, name: str, attributes: Mapping[str, Any]) -> Iterator[Any]:
        with self._tracer.start_as_current_span(name, attributes=dict(attributes)) as current:
            yield current

    def shutdown(self) -> None:
        """Export what is buffered (the daemon's own provider only; an application's is its own)."""
        if self._provider is not None:
            self._provider.shutdown()


def _exporter(env: Mapping[str, str]) -> Any:
    kind = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind != "otlp":
        raise ConfigurationError(f"OTEL_TRACES_EXPORTER must be otlp, console or none, got {kind!r}")
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
                OTLPSpanExporter,
            )
        else:
            raise ConfigurationError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be http/protobuf or grpc, got {protocol!r}")
    except ImportError:
        package = "opentelemetry-exporter-otlp-proto-grpc" if protocol == "grpc" else "outboxd[otel]"
        raise ConfigurationError(f"OTLP over {protocol} needs {package} installed") from None
    return OTLPSpanExporter()  # endpoint, headers, timeout: from OTEL_EXPORTER_OTLP_* itself


def configure(env: Mapping[str, str] = os.environ) -> Tracing | None:
    """The daemon's tracing, or ``None`` (off): the application's provider when one is set,
    else one built from the ``OTEL_*`` environment when it asks for traces."""
    if not requested(env):
        if "opentelemetry.trace" not in sys.modules:  # the application does not trace: import nothing
            return None
        from opentelemetry import trace

        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider) or type(provider).__name__ == "NoOpTracerProvider":
            return None
        return Tracing(provider.get_tracer("outboxd"), None)
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ConfigurationError("OTEL_* asks for traces, but the [otel] extra is not installed: "
                                 "pip install 'outboxd[otel]'") from None
    service = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": DEFAULT_SERVICE_NAME}
    provider = TracerProvider(resource=Resource.create(service))  # OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
    provider.add_span_processor(BatchSpanProcessor(_exporter(env)))
    return Tracing(provider.get_tracer("outboxd"), provider)


def install(tracing: Tracing | None) -> None:
    """Make ``tracing`` the process's (``None``: off) for :func:`span`."""
    global _active
    _active = tracing


def span(name: str, attributes: Mapping[str, Any]) -> ContextManager[Any]:
    """A span around a claim or a flush when tracing is on; nothing when off."""
    return nullcontext() if _active is None else _active.span(name, attributes)
