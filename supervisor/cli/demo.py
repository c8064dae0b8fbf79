"""``outboxd demo``: the whole product end to end, on SQLite, with no configuration.

A seller enqueues task webhooks and a delivery-report stream in its own transactions; the
daemon signs and delivers them to a local receiver that verifies every signature with an
independent RFC 9421 implementation and answers some first attempts with 503, so retries
(same bytes, same key) are visible in the table printed at the end.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from sqlalchemy import select

import outbox
from outbox.config import load_settings
from outbox.db import make_async_engine, make_engine
from outbox.migrate import upgrade
from outbox.schema import messages
from supervisor.cycle.daemon import Daemon
from supervisor.observe.logs import configure_logging
from outboxd_receiver import Receiver, library_verifier, serve
from supervisor.wire.signing import generate_signing_key_pem, load_signing_key

DEADLINE_SECONDS = 60.0
KEY_ID = "outboxd-demo-key"


def _prepare(workdir: Path) -> tuple[str, Path]:
    workdir.mkdir(parents=True, exist_ok=True)
    key_file = workdir / "demo-signing-key.pem"
    if not key_file.exists():
        key_file.write_bytes(generate_signing_key_pem())
        key_file.chmod(0o600)
    database = workdir / "outbox.db"
    for stale in workdir.glob("outbox.db*"):
        stale.unlink()  # a fresh run every time
    url = f"sqlite:///{database}"
    upgrade(make_engine(url))
    return url, key_file


def _enqueue(url: str, port: int, count: int) -> None:
    settings = load_settings(env={"OUTBOX_ALLOW_HTTP": "true", "OUTBOX_ALLOWED_CIDRS": "127.0.0.0/8"})
    engine = make_engine(url)
    base = f"http://127.0.0.1:{port}"
    for i in range(count):
        path = "/flaky/1" if i % 3 == 0 else "/ok"  # every third buyer answers 503 once
        with engine.begin() as conn:  # the seller's own transaction
            outbox.enqueue_task_webhook(
                conn, tenant_id=f"seller-{i % 2}", task_id=f"task_{i}", task_type="create_media_buy",
                status="completed", result={"media_buy_id": f"mb_{i}", "status": "active"},
                push_notification_config={"url": f"{base}{path}?buyer={i}", "operation_id": f"op_{i}",
                                          "token": "demo-token-0123456789"},
                context={"demo": True}, settings=settings)
    report = {"notification_type": "scheduled", "currency": "USD", "media_buy_deliveries": [],
              "reporting_period": {"start": "2026-11-28T00:00:00Z", "end": "2026-11-29T00:00:00Z"}}
    for _ in range(3):
        with engine.begin() as conn:
            outbox.enqueue_delivery_report(
                conn, tenant_id="seller-0", media_buy_id="mb_0", result=report, settings=settings,
                reporting_webhook={"url": f"{base}/flaky/1", "operation_id": "op_reports",
                                   "token": "demo-token-0123456789"})
    engine.dispose()


async def _deliver(url: str, key_file: Path, count: int) -> tuple[Receiver, list[dict], bool]:
    """Deliver the demo's messages; the receiver, the messages, and whether a stop signal
    (SIGTERM, Ctrl-C) ended the daemon before they were all done."""
    key = load_signing_key(key_file, KEY_ID)
    receiver = Receiver(library_verifier({"keys": [key.public_jwk()]}), None)
    server = await serve(receiver)
    port = server.sockets[0].getsockname()[1]
    await asyncio.to_thread(_enqueue, url, port, count)
    settings = load_settings(env={}, database_url=url, signing_key_file=str(key_file), signing_key_id=KEY_ID,
                             allow_http=True, allowed_cidrs=load_settings(
                                 env={"OUTBOX_ALLOWED_CIDRS": "127.0.0.0/8"}).allowed_cidrs,
                             retry_base_seconds=1.0, poll_interval_seconds=0.2)
    daemon = Daemon(settings)
    stop = asyncio.Event()
    running = asyncio.create_task(daemon.run(stop))
    engine = make_async_engine(url)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE_SECONDS
        while loop.time() < deadline and not running.done():
            async with engine.connect() as conn:
                rows = [dict(r) for r in (await conn.execute(select(messages).order_by(messages.c.id))).mappings()]
            if rows and all(r["state"] in ("delivered", "dead") for r in rows):
                break
            await asyncio.sleep(0.2)
        interrupted = running.done()  # the daemon ends by itself only when signalled (or it raised)
    finally:
        stop.set()
        await running
        await engine.dispose()
        server.close()
    return receiver, rows, interrupted


def run_demo(workdir: Path, *, messages: int = 6) -> int:
    configure_logging("console" if sys.stderr.isatty() else "json", level=40)  # errors only: keep it readable
    url, key_file = _prepare(workdir)
    print(f"outboxd demo: SQLite at {workdir / 'outbox.db'}, dev signing key {key_file}")
    receiver, rows, interrupted = asyncio.run(_deliver(url, key_file, messages))
    if interrupted:
        delivered = sum(r["state"] == "delivered" for r in rows)
        print(f"outboxd demo: stopped by a signal with {delivered} of {len(rows)} messages delivered",
              file=sys.stderr)
        return 130
    print()
    print(f"{'ID':>3}  {'IDEMPOTENCY_KEY':40}  {'SEQ':>3}  {'ATTEMPTS':>8}  OUTCOME")
    for r in rows:
        outcome = r["state"] if r["state"] != "dead" else f"dead ({r['dead_reason']})"
        seq = json.loads(r["body"]).get("result", {}).get("sequence_number") if r["sequence_number"] else None
        print(f"{r['id']:>3}  {r['idempotency_key']:40}  {seq or '-':>3}  {r['attempts']:>8}  {outcome}")
    delivered = sum(r["state"] == "delivered" for r in rows)
    print()
    print(f"{delivered}/{len(rows)} delivered; receiver saw {receiver.arrivals} requests, "
          f"{receiver.arrivals - receiver.failures} with a valid RFC 9421 signature")
    if delivered != len(rows) or receiver.failures:
        print("demo FAILED: not every message was delivered with a valid signature", file=sys.stderr)
        return 1
    print("every message delivered, every signature verified; retries reused the same bytes and key")
    return 0
