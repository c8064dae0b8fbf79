"""``outboxd endpoints``: per-endpoint health over a sliding window (supervisor/observe/health_stats.py)."""

from __future__ import annotations

import argparse
from typing import Any

from outbox.config import Settings
from supervisor.cli.common import (
    Subcommands,
    UsageError,
    endpoint_origin_arg,
    parse_duration,
    positive_int,
    print_json,
    run_async,
    table,
)


def _percent(value: float | None) -> str | None:
    return None if value is None else f"{value * 100:.1f}%"


def _ms(value: float | None) -> str | None:
    return None if value is None else f"{value:.0f}ms"


def cmd_endpoints(args: argparse.Namespace, settings: Settings) -> int:
    from supervisor.observe.health_stats import RETENTION_SECONDS, endpoint_health

    if not 60 <= args.window <= RETENTION_SECONDS:
        raise UsageError(f"--window must be between 1m and {RETENTION_SECONDS // 3600}h")

    async def work(conn: Any) -> Any:
        return await endpoint_health(conn, window_seconds=args.window, tenant=args.tenant, origin=args.origin,
                                     limit=args.limit)

    rows = run_async(settings, work, reads_only=True)
    if args.json:
        print_json([h.as_dict() for h in rows])
        return 0
    table([(f"{h.tenant_id}@{h.origin}", h.attempts, _percent(h.success_rate), _ms(h.latency_p50_ms),
            _ms(h.latency_p95_ms), h.deaths, h.breaker_state) for h in rows],
          ["ENDPOINT", "ATTEMPTS", "SUCCESS", "P50", "P95", "DEAD", "BREAKER"])
    return 0


def register(add: Subcommands) -> None:
    p = add("endpoints", "Health of each endpoint (tenant and origin) over a sliding window: attempts, success "
                         "rate, p50/p95 latency, messages dead, breaker state; busiest first.", cmd_endpoints)
    p.add_argument("--window", type=parse_duration, default=3600.0, metavar="DURATION",
                   help="how far back, in whole minutes, up to 24h (default 1h)")
    p.add_argument("--tenant", help="only this tenant")
    p.add_argument("--origin", type=endpoint_origin_arg,
                   help="only this endpoint's origin, e.g. https://buyer.example.com (any URL of it)")
    p.add_argument("--limit", type=positive_int, default=100, help="at most this many endpoints (default 100)")
    p.add_argument("--json", action="store_true", help="print JSON")
