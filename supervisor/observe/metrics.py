"""Prometheus metrics of the daemon: names prefixed ``outbox_``, base units, bounded labels.

No label ever carries a message id, URL or tenant, unless the operator turns per-tenant
labels on (``OUTBOX_PER_TENANT_METRICS``) for the two per-tenant counters, or asks for the
health of the N busiest endpoints (``OUTBOX_ENDPOINT_METRICS_TOP``): at most N label sets.
"""

from __future__ import annotations

import math

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from collections.abc import Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, PlatformCollector

from outbox.schema import DEAD_REASONS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600, 21600, 86400)
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20)
BATCH_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500)
ENDPOINT_WINDOW_SECONDS = 300  # the window of the per-endpoint health series

if TYPE_CHECKING:
    from supervisor.observe.health_stats import EndpointHealth


def package_version() -> str:
    """The installed distribution's version; from a source checkout, pyproject.toml's."""
    try:
        return version("outboxd")
    except PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        try:
            return str(tomllib.loads(pyproject.read_text())["project"]["version"])
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


def status_class(status: int | None) -> str:
    return "none" if status is None else f"{status // 100}xx"


# The series a daemon commonly writes, created at 0 (see Metrics.__init__).
BREAKER_TRANSITIONS = (("closed", "open"), ("open", "half_open"), ("half_open", "open"), ("half_open", "closed"))
ATTEMPT_SERIES = (("success", "2xx"), ("failed", "3xx"), ("failed", "4xx"), ("failed", "5xx"), ("timeout", "none"),
                  ("connection_error", "none"))


class Metrics:
    """All metric families of one daemon, on their own registry."""

    def __init__(self, *, per_tenant: bool = False, endpoint_top: int = 0) -> None:
        self.registry = CollectorRegistry()
        self.per_tenant = per_tenant
        self.endpoint_top = endpoint_top
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        tenant = ["tenant"] if per_tenant else []
        self.deliveries = Counter("outbox_deliveries", "Messages finished, by final outcome.",
                                  ["outcome", *tenant], registry=r)
        self.attempts = Counter("outbox_attempts", "Delivery attempts, by outcome and HTTP status class.",
                                ["outcome", "status_class", *tenant], registry=r)
        self.attempt_duration = Histogram("outbox_attempt_duration_seconds", "Time of one HTTP attempt.",
                                          buckets=DURATION_BUCKETS, registry=r)
        self.commit_to_delivery = Histogram("outbox_commit_to_delivery_seconds",
                                            "From the enqueueing commit to the recorded delivery.",
                                            buckets=LATENCY_BUCKETS, registry=r)
        # Live states only (cheap to count); finished ones are outbox_deliveries_total.
        self.messages = Gauge("outbox_messages", "Messages pending or in flight, by state (sampled).", ["state"],
                              registry=r)
        self.oldest_due_age = Gauge("outbox_oldest_due_message_age_seconds",
                                    "How long the oldest due message has been waiting (sampled).", registry=r)
        self.delivery_lag = Gauge("outbox_delivery_lag_seconds",
                                  "How long the oldest due message that no open or half-open breaker holds back "
                                  "has been waiting: the daemons' own lag (sampled).", registry=r)
        self.dead_letters = Counter("outbox_dead_letters", "Messages that became dead, by reason.", ["reason"],
                                    registry=r)
        self.lease_rescues = Counter("outbox_lease_rescues", "Leases taken back from a daemon that died "
                                     "mid-attempt (each logged as an abandoned attempt).", registry=r)
        self.database_outages = Counter("outbox_database_outages", "Runs of failed database calls this process "
                                        "rode out (or died of, past OUTBOX_DATABASE_OUTAGE_SECONDS).",
                                        registry=r)
        self.database_errors = Counter("outbox_database_errors", "Failed database calls by cause: connection, "
                                       "timeout, statement, prepared_statements and pooler_startup (a transaction "
                                       "pooler; docs/pooler.md).", ["cause"], registry=r)
        self.bodies_resealed = Counter("outbox_bodies_resealed", "Stored bodies moved onto the active encryption key.",
                                       registry=r)
        self.sealed_unopenable = Gauge(
            "outbox_sealed_rows_unopenable", "Messages to deliver sealed under a key this process lacks: held, "
            "not sent, until a process with the key takes them.", registry=r)
        self.reseal_backlog = Gauge("outbox_encryption_reseal_backlog",
                                    "Messages not yet sealed under the agreed key (rotation progress).", registry=r)
        self.rotation_waiting = Gauge("outbox_encryption_rotation_waiting_processes",
                                      "Live processes that cannot open the newest announced key yet: it seals "
                                      "only once this is 0.", registry=r)
        self.ready = Gauge("outbox_ready", "1 when /readyz would answer 200, taken at each scrape: 0 while the "
                           "database keeps failing, its schema is behind or too new, or messages wait for a key "
                           "this process lacks (/readyz says which).", registry=r)
        self.breakers = Gauge("outbox_breakers", "Circuit breakers by state (sampled).", ["state"], registry=r)
        self.breakers_holding_back = Gauge("outbox_breakers_holding_back",
                                           "Endpoints whose pending messages an open or half-open breaker holds "
                                           "back (sampled).", registry=r)
        self.breaker_transitions = Counter("outbox_breaker_transitions", "Circuit breaker state changes.",
                                           ["from_state", "to_state"], registry=r)
        self.in_flight = Gauge("outbox_in_flight_requests", "HTTP requests in flight in this process.",
                               registry=r)
        self.claim_batch = Histogram("outbox_claim_batch_size", "Messages leased per claim.",
                                     buckets=BATCH_BUCKETS, registry=r)
        self.sink_errors = Counter("outbox_sink_errors", "Attempts a sink failed to take (timeout, error, full).",
                                   ["sink"], registry=r)
        self.proofs = Counter("outbox_subscriber_proofs", "URL proofs of account-level subscribers settled, by "
                              "outcome (proven, failed).", ["outcome"], registry=r)
        self.held_fires = Counter("outbox_held_fires", "Fires held for a subscriber's URL proof that the proof "
                                  "settled: released (due now) or dead (proof_failed).", ["outcome"], registry=r)
        self.signing_active_keys = Gauge("outbox_signing_active_keys", "Signing keys able to sign now, per keyring "
                                         "scope: 0 means that scope's webhooks wait for a key.", ["scope"],
                                         registry=r)
        self.reporting_handoffs = Counter("outbox_reporting_handoffs", "SDK reporting deliveries handed off, by the "
                                          "state they were finished with (docs/reporting.md).", ["state"], registry=r)
        self.reporting_backlog = Gauge("outbox_reporting_handoff_backlog", "SDK reporting work not yet in outboxd: "
                                       "events to expand, deliveries to hand off (sampled).", ["queue"], registry=r)
        self.reporting_handoff_errors = Counter("outbox_reporting_handoff_errors", "Hand-off turns that failed "
                                                "(retried on the next turn).", registry=r)
        self.build_info = Gauge("outbox_build_info", "Version of the running outboxd.", ["version"], registry=r)
        self.build_info.labels(version=package_version()).set(1)
        # The database's gauges read NaN until their first sample: a daemon restarted while its
        # database is away has none, and a 0 would read as "nothing waits, no breaker open".
        for state in ("pending", "in_flight"):
            self.messages.labels(state=state).set(math.nan)
        for state in ("closed", "open", "half_open"):
            self.breakers.labels(state=state).set(math.nan)
        for gauge in (self.oldest_due_age, self.delivery_lag, self.breakers_holding_back):
            gauge.set(math.nan)
        for outcome in ("proven", "failed"):
            self.proofs.labels(outcome=outcome)
        for outcome in ("released", "dead"):
            self.held_fires.labels(outcome=outcome)
        for cause in ("connection", "timeout", "statement", "prepared_statements", "pooler_startup"):
            self.database_errors.labels(cause=cause)
        # Counters exported at 0 before their first event: a series that appears already at 1
        # is lost to rate() and increase(), so the first dead letter (OutboxSignatureRejected)
        # would never alert. Per-tenant series still start with their tenant's first event.
        for reason in DEAD_REASONS:
            self.dead_letters.labels(reason=reason)
        for before, after in BREAKER_TRANSITIONS:
            self.breaker_transitions.labels(from_state=before, to_state=after)
        if not per_tenant:
            for outcome in ("delivered", "dead"):
                self.deliveries.labels(outcome=outcome)
            for outcome, status in ATTEMPT_SERIES:
                self.attempts.labels(outcome=outcome, status_class=status)
        if endpoint_top:
            endpoint = ["tenant", "origin"]
            window = f"over the last {ENDPOINT_WINDOW_SECONDS // 60} minutes, busiest endpoints (sampled)."
            self.endpoint_attempts = Gauge("outbox_endpoint_attempts", f"Attempts {window}", endpoint, registry=r)
            self.endpoint_success_ratio = Gauge("outbox_endpoint_success_ratio", f"Share of 2xx answers {window}",
                                                endpoint, registry=r)
            self.endpoint_deaths = Gauge("outbox_endpoint_deaths", f"Messages ended dead {window}", endpoint,
                                         registry=r)
            self.endpoint_latency = Gauge("outbox_endpoint_latency_seconds", f"Attempt latency quantile {window}",
                                          [*endpoint, "quantile"], registry=r)

    def set_endpoints(self, health: Sequence["EndpointHealth"]) -> None:
        """Replace the per-endpoint series with ``health`` (endpoints that left the top N vanish)."""
        for gauge in (self.endpoint_attempts, self.endpoint_success_ratio, self.endpoint_deaths,
                      self.endpoint_latency):
            gauge.clear()
        for h in health:
            self.endpoint_attempts.labels(h.tenant_id, h.origin).set(h.attempts)
            self.endpoint_deaths.labels(h.tenant_id, h.origin).set(h.deaths)
            if h.success_rate is not None:
                self.endpoint_success_ratio.labels(h.tenant_id, h.origin).set(h.success_rate)
            for q, value in (("0.5", h.latency_p50_ms), ("0.95", h.latency_p95_ms)):
                if value is not None:
                    self.endpoint_latency.labels(h.tenant_id, h.origin, q).set(value / 1000)

    def tenant_labels(self, tenant_id: str) -> dict[str, str]:
        return {"tenant": tenant_id} if self.per_tenant else {}

    def count_dead(self, reason: str | None, tenant_id: str) -> None:
        """One message finished dead: the final-outcome counter and the dead-letter counter agree."""
        self.deliveries.labels(outcome="dead", **self.tenant_labels(tenant_id)).inc()
        self.dead_letters.labels(reason=reason).inc()
