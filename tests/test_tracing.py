"""OpenTelemetry: a seller's span, through the enqueue, to the real daemon's attempt spans,
exported over OTLP/HTTP to a collector on loopback that decodes what it receives with the
OpenTelemetry protobuf definitions; and nothing of OpenTelemetry loaded when it is off."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from sqlalchemy import select

import outbox
from outbox.schema import attempts, messages
from tests import procs
from tests.ledger import PRODUCER


def _value(any_value: Any) -> Any:
    return getattr(any_value, any_value.WhichOneof("value"))


class Collector:
    """An OTLP/HTTP trace receiver: every span of every export request, decoded."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        lock = threading.Lock()
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with lock:
                    for resource in request.resource_spans:
                        service = {a.key: _value(a.value) for a in resource.resource.attributes}.get("service.name")
                        for scope in resource.scope_spans:
                            for s in scope.spans:
                                spans.append({"service": service, "name": s.name, "kind": s.kind,
                                              "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                              "parent": s.parent_span_id.hex() or None,
                                              "status": s.status.code,
                                              "attributes": {a.key: _value(a.value) for a in s.attributes}})
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.close()


@pytest.mark.e2e
def test_attempt_spans_are_children_of_the_sellers_span(pg_engine, pg_url, tmp_path, keypair, collector):
    key, jwks = keypair
    # The seller's own provider (not the global one), exporting to the same collector.
    seller = TracerProvider()
    seller.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{collector.endpoint}/v1/traces")))
    tracer = seller.get_tracer("seller-app")
    with procs.receiver(tmp_path, jwks) as (port, log):
        base = f"http://127.0.0.1:{port}"
        with tracer.start_as_current_span("POST /media_buys") as request_span:
            with pg_engine.begin() as conn:
                flaky = outbox.enqueue_task_webhook(
                    conn, tenant_id="acme", task_id="t1", task_type="create_media_buy", status="completed",
                    settings=PRODUCER, push_notification_config={"url": f"{base}/flaky/2?secret=s3",
                                                                 "operation_id": "op"})
                ok = outbox.enqueue_task_webhook(
                    conn, tenant_id="acme", task_id="t2", task_type="create_media_buy", status="completed",
                    settings=PRODUCER, push_notification_config={"url": f"{base}/ok", "operation_id": "op"})
        with pg_engine.begin() as conn:  # outside any span: no trace context, a root span
            untraced = outbox.enqueue_task_webhook(
                conn, tenant_id="acme", task_id="t3", task_type="create_media_buy", status="completed",
                settings=PRODUCER, push_notification_config={"url": f"{base}/ok", "operation_id": "op"})
        seller.shutdown()
        sellers = request_span.get_span_context()
        env = procs.daemon_env(pg_url, key, retry_base_seconds="0.2")
        env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_SERVICE_NAME": "outboxd-e2e",
                    "OTEL_BSP_SCHEDULE_DELAY": "200"})
        daemon = procs.start_daemon(env, tmp_path / "d.log")
        try:
            assert procs.wait_until(lambda: len(procs.arrivals(log)) >= 5, 60)

            def delivered() -> bool:
                with pg_engine.connect() as conn:
                    return set(conn.execute(select(messages.c.state)).scalars()) == {"delivered"}
            assert procs.wait_until(delivered, 30)
        finally:
            assert procs.stop(daemon) == 0  # a clean stop exports the last spans
    with pg_engine.connect() as conn:
        stored = dict(conn.execute(select(messages.c.idempotency_key, messages.c.traceparent)).all())
        rows = conn.execute(select(attempts.c.idempotency_key, attempts.c.attempt_number, attempts.c.trace_id,
                                   attempts.c.span_id)).all()
    trace_id, span_id = f"{sellers.trace_id:032x}", f"{sellers.span_id:016x}"
    assert stored[flaky.idempotency_key] == f"00-{trace_id}-{span_id}-{int(sellers.trace_flags):02x}"
    assert stored[untraced.idempotency_key] is None
    assert procs.wait_until(lambda: sum(s["name"] == "POST" for s in collector.spans) >= 5, 30)
    spans = {s["span_id"]: s for s in collector.spans}
    assert spans[span_id]["name"] == "POST /media_buys"  # the seller's span reached the collector too
    attempt_spans = [s for s in collector.spans if s["name"] == "POST" and s["service"] == "outboxd-e2e"]
    by_key: dict[str, list[dict[str, Any]]] = {}
    for s in attempt_spans:
        by_key.setdefault(s["attributes"]["outboxd.idempotency_key"], []).append(s)
    assert sorted(s["attributes"]["outboxd.attempt"] for s in by_key[flaky.idempotency_key]) == [1, 2, 3]
    for key in (flaky.idempotency_key, ok.idempotency_key):  # the seller's request is every attempt's parent
        for s in by_key[key]:
            assert (s["trace_id"], s["parent"]) == (trace_id, span_id)
            assert s["kind"] == 3  # SPAN_KIND_CLIENT
            assert s["attributes"]["url.full"] == f"{base}/{'flaky/2' if key == flaky.idempotency_key else 'ok'}"
            assert s["attributes"]["outboxd.tenant_id"] == "acme" and s["attributes"]["http.request.method"] == "POST"
    statuses = sorted((s["attributes"]["outboxd.attempt"], s["attributes"]["http.response.status_code"],
                       s["attributes"]["outboxd.outcome"], s["status"]) for s in by_key[flaky.idempotency_key])
    assert statuses == [(1, 503, "failed", 2), (2, 503, "failed", 2), (3, 200, "success", 0)]
    [root] = by_key[untraced.idempotency_key]
    assert root["parent"] is None and root["trace_id"] != trace_id
    # the attempt rows and the attempt log lines carry the ids of the exported spans
    exported = {(s["attributes"]["outboxd.idempotency_key"], s["attributes"]["outboxd.attempt"]):
                (s["trace_id"], s["span_id"]) for s in attempt_spans}
    assert {(r.idempotency_key, r.attempt_number): (r.trace_id, r.span_id) for r in rows} == exported
    lines = [json.loads(line) for line in (tmp_path / "d.log").read_text().splitlines() if line.startswith("{")]
    logged = {(e["idempotency_key"], e["attempt_number"]): (e["trace_id"], e["span_id"])
              for e in lines if e.get("event") == "delivery.attempt"}
    assert logged == exported
    names = {s["name"] for s in collector.spans if s["service"] == "outboxd-e2e"}
    assert {"outboxd.claim", "outboxd.flush"} <= names


def test_off_unless_configured_and_nothing_imported(pg_url, tmp_path):
    """Without OTEL_* and without an application tracer, neither the enqueue nor the daemon
    loads OpenTelemetry, the message keeps no trace context and the log line no span ids."""
    script = f"""
import sys, asyncio, outbox
from outbox.db import make_engine
from supervisor.observe import tracing
from supervisor.cycle.daemon import Daemon
settings = outbox.load_settings(env={{"OUTBOX_DATABASE_URL": {pg_url!r}, "OUTBOX_ALLOW_HTTP": "true",
                                      "OUTBOX_ALLOWED_CIDRS": "127.0.0.0/8"}})
engine = make_engine({pg_url!r})
with engine.begin() as conn:
    outbox.enqueue(conn, tenant_id="t", url="http://127.0.0.1:9/x", payload={{"task_id": "x"}},
                   idempotency_key="k-off-0123456789",
                   settings=settings)
assert tracing.configure({{}}) is None
daemon = Daemon(settings)
assert daemon.tracing is None
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""
    env = {k: v for k, v in procs.daemon_env(pg_url, tmp_path / "none.pem").items() if not k.startswith("OTEL_")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
