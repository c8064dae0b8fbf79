"""The enqueue phase: what an enqueue adds to a committed seller transaction, measured side by
side in one process, in rounds that interleave every variant (so the box's drift hits them
alike): the seller's transaction alone (one ``UPDATE``), the same with outboxd's
``enqueue_task_webhook``, ``enqueue_delivery_report`` and ``enqueue_event`` (one subscriber),
and, with ``--peer adcp``, the same transaction alone and with the SDK's
``PgTaskWebhookOutbox.enqueue_terminal`` on the SDK's own driver (psycopg's async pool, as
the SDK is used). Each "added" figure is a variant's p50 minus the p50 of the transaction
alone on the same driver.

Both sides run with psycopg's statement preparation as a seller's own engine has it
(docs/enqueue.md): psycopg's default (repeated statements prepared) on a direct connection,
none behind a transaction pooler (``OUTBOX_DATABASE_POOLER=transaction``, docs/pooler.md).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from outboxd_bench.harness import Bench
from outboxd_bench.procs import CpuMeter, percentile

ENQUEUE_ROUNDS = 1_000  # at most; fewer when --messages is smaller
ACCOUNT = "acct_bench"
PNC = {"url": "https://buyer.example.com/hooks/adcp", "operation_id": "op_1", "token": "tok_abcdefghijklmnop"}
REPORTING = {"url": "https://buyer.example.com/reports", "operation_id": "op_rep", "token": "reporttoken123456"}
DELIVERY = {"notification_type": "scheduled", "reporting_period": {"start": "2026-11-01T00:00:00Z",
            "end": "2026-11-02T00:00:00Z"}, "currency": "USD", "media_buy_deliveries": []}
STATUS_EVENT = {"account_id": ACCOUNT, "previous_status": "pending_approval", "status": "active",
                "observed_at": "2026-12-01T10:00:00Z", "reason_code": "seller_approved"}
MAX_ADDED_RATIO = 0.5  # outboxd's added p50 against the SDK's


def seller_driver_options(settings: Any) -> dict[str, Any]:
    """The psycopg options of a seller's own connections: psycopg's defaults, and no prepared
    statements behind a transaction pooler (docs/pooler.md)."""
    return {"prepare_threshold": None} if settings.database_pooler == "transaction" else {}


def phase_enqueue(bench: Bench) -> dict[str, Any]:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    import outbox
    from outbox.config import with_overrides

    bench.truncate()
    # The seller's own engine (docs/enqueue.md), not the bench's pooler-safe one.
    seller_engine = create_engine(make_url(bench.settings.database_url).set(drivername="postgresql+psycopg"),
                                  pool_size=1, connect_args=seller_driver_options(bench.settings))
    # a subscriber's URL proof names the seller agent (never reached here: the proof is skipped)
    settings = with_overrides(bench.producer_settings, seller_agent_url="https://seller.example/adcp")
    with bench.engine.begin() as conn:
        conn.execute(text("DROP TABLE IF EXISTS bench_media_buys"))
        conn.execute(text("CREATE TABLE bench_media_buys (id int PRIMARY KEY, status text)"))
        conn.execute(text("INSERT INTO bench_media_buys VALUES (1, 'pending')"))
        outbox.register_subscriber(conn, tenant_id="bench-tenant-0", account_id=ACCOUNT, settings=settings,
                                   notification_config={"subscriber_id": "s1", "url": bench.main.url("/ok"),
                                                        "event_types": ["account.status_changed"]})
        conn.execute(text("UPDATE outbox_subscribers SET state = 'active'"))  # as if its proof had passed
    seller = text("UPDATE bench_media_buys SET status = :s WHERE id = 1")

    def variant(enqueue: Callable[[Any, int], Any] | None) -> Callable[[int], float]:
        def once(i: int) -> float:
            started = time.perf_counter()
            with seller_engine.begin() as conn:
                conn.execute(seller, {"s": f"s{i}"})
                if enqueue is not None:
                    enqueue(conn, i)
            return (time.perf_counter() - started) * 1000
        return once

    run = bench.run_id
    variants: dict[str, Callable[[int], float]] = {
        "alone": variant(None),
        "task_webhook": variant(lambda c, i: outbox.enqueue_task_webhook(
            c, tenant_id="bench-tenant-0", push_notification_config=PNC, task_id=f"task_{run}_{i}",
            task_type="create_media_buy", status="completed", result={"media_buy_id": "mb_1"}, settings=settings)),
        "delivery_report": variant(lambda c, i: outbox.enqueue_delivery_report(
            c, tenant_id="bench-tenant-0", reporting_webhook=REPORTING, media_buy_id="mb_1", result=DELIVERY,
            idempotency_key=f"whk_rep_{run}_{i}", settings=settings)),
        "event": variant(lambda c, i: outbox.enqueue_event(
            c, tenant_id="bench-tenant-0", account_id=ACCOUNT, notification_type="account.status_changed",
            payload=STATUS_EVENT, settings=settings)),
    }
    peer = _SdkVariants(bench) if bench.options.peer == "adcp" else None
    if peer is not None:
        variants.update(peer.variants())
    samples: dict[str, list[float]] = {name: [] for name in variants}
    rounds = min(ENQUEUE_ROUNDS, bench.options.messages)
    try:
        meter = CpuMeter(bench.engine, [], []).start()  # what else ran meanwhile: the noise warning
        for i in range(rounds):
            for name, once in variants.items():
                samples[name].append(once(i))
        usage = meter.stop()
    finally:
        seller_engine.dispose()
        if peer is not None:
            peer.close()
        with bench.engine.begin() as conn:
            conn.execute(text("DROP TABLE IF EXISTS bench_media_buys"))
        bench.truncate()
    p50 = {name: round(percentile(values, 50), 3) for name, values in samples.items()}
    p99 = {name: round(percentile(values, 99), 3) for name, values in samples.items()}
    added = {name: round(p50[name] - p50["alone"], 3) for name in ("task_webhook", "delivery_report", "event")}
    result: dict[str, Any] = {"rounds": rounds, "p50_ms": p50, "p99_ms": p99, "added_p50_ms": added,
                              "prepared_statements": not seller_driver_options(bench.settings), "cpu": usage}
    if peer is not None:
        sdk = round(p50["sdk_enqueue_terminal"] - p50["sdk_alone"], 3)
        result["sdk_added_p50_ms"] = sdk
        result["added_ratio_to_sdk"] = {name: round(value / max(sdk, 1e-6), 3) for name, value in added.items()}
    return result


class _SdkVariants:
    """The SDK's transaction alone and with ``enqueue_terminal``, on its own event loop and pool."""

    def __init__(self, bench: Bench) -> None:
        from outbox.db import libpq_url

        self._dsn = libpq_url(bench.settings.database_url)
        self._url = bench.main.url("/ok")
        self._options = seller_driver_options(bench.settings)
        self._loop = asyncio.new_event_loop()
        self._outbox, self._pool = self._loop.run_until_complete(self._open())

    async def _open(self) -> tuple[Any, Any]:
        from adcp.decisioning.pg.task_webhook_outbox import PgTaskWebhookOutbox
        from adcp.webhook_sender import WebhookSender
        from cryptography.hazmat.primitives.asymmetric import ed25519
        from psycopg_pool import AsyncConnectionPool

        from outboxd_bench.peer import TABLE

        pool = AsyncConnectionPool(self._dsn, open=False, kwargs=self._options)
        await pool.open()
        sender = WebhookSender(private_key=ed25519.Ed25519PrivateKey.generate(), key_id="bench-peer", alg="ed25519")
        sdk = PgTaskWebhookOutbox(pool=pool, sender=sender, encryption_key=os.urandom(32),
                                  delivery_retry_horizon_seconds=86_400)
        async with pool.connection() as conn:
            await conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
        await sdk.create_schema()
        return sdk, pool

    def variants(self) -> dict[str, Callable[[int], float]]:
        return {"sdk_alone": lambda i: self._loop.run_until_complete(self._once(i, False)),
                "sdk_enqueue_terminal": lambda i: self._loop.run_until_complete(self._once(i, True))}

    async def _once(self, i: int, enqueue: bool) -> float:
        started = time.perf_counter()
        async with self._pool.connection() as conn:
            async with conn.transaction():
                await conn.execute("UPDATE bench_media_buys SET status = %s WHERE id = 1", (f"p{i}",))
                if enqueue:
                    await self._outbox.enqueue_terminal(
                        conn, task_id=f"peer_task_{i}", account_id="bench-tenant-0", task_type="create_media_buy",
                        status="completed", url=self._url, operation_id=f"op_{i}",
                        token="bench-token-0123456789abcdef", result={"media_buy_id": "mb_1"})
        return (time.perf_counter() - started) * 1000

    def close(self) -> None:
        from outboxd_bench.peer import TABLE

        async def shut() -> None:
            async with self._pool.connection() as conn:
                await conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
            await self._pool.close()

        self._loop.run_until_complete(shut())
        self._loop.close()


def enqueue_figures(phase: dict[str, Any]) -> dict[str, Any]:
    out = {f"enqueue_{name}_added_p50_ms": value for name, value in phase["added_p50_ms"].items()}
    if "sdk_added_p50_ms" in phase:
        out["enqueue_sdk_added_p50_ms"] = phase["sdk_added_p50_ms"]
        out.update({f"enqueue_{name}_ratio_to_sdk": v for name, v in phase["added_ratio_to_sdk"].items()})
    return out


def enqueue_targets(f: dict[str, Any]) -> list[tuple[str, Any, str, bool]]:
    if "enqueue_sdk_added_p50_ms" not in f:
        return []
    return [(f"{name.replace('_', ' ')} enqueue adds <= {MAX_ADDED_RATIO} x the SDK's (p50)",
             f[f"enqueue_{name}_ratio_to_sdk"], f"<= {MAX_ADDED_RATIO}",
             f[f"enqueue_{name}_ratio_to_sdk"] <= MAX_ADDED_RATIO)
            for name in ("task_webhook", "delivery_report", "event")]


def render_enqueue(phase: dict[str, Any]) -> list[str]:
    p50, p99 = phase["p50_ms"], phase["p99_ms"]
    driver = ("psycopg's default statement preparation" if phase.get("prepared_statements")
              else "no prepared statements (pooler)")
    lines = [f"ENQUEUE: a committed seller transaction (one UPDATE), {phase['rounds']:,} interleaved rounds, "
             f"both sides with {driver}",
             f"  {'':46}{'p50 ms':>8}{'p99 ms':>8}{'added p50':>11}"]
    rows = [("alone (SQLAlchemy)", "alone", None), ("+ enqueue_task_webhook", "task_webhook", "alone"),
            ("+ enqueue_delivery_report", "delivery_report", "alone"),
            ("+ enqueue_event (1 subscriber)", "event", "alone"),
            ("alone (SDK's psycopg pool)", "sdk_alone", None),
            ("+ adcp PgTaskWebhookOutbox.enqueue_terminal", "sdk_enqueue_terminal", "sdk_alone")]
    for label, key, base in rows:
        if key in p50:
            added = f"{p50[key] - p50[base]:>11.3f}" if base else ""
            lines.append(f"  {label:46}{p50[key]:>8.3f}{p99[key]:>8.3f}{added}")
    if "added_ratio_to_sdk" in phase:
        lines.append("  added / the SDK's: " + ", ".join(f"{k} {v:g}" for k, v in phase["added_ratio_to_sdk"].items()))
    return [*lines, ""]
