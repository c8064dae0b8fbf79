"""End to end on the ``adcp`` SDK: the example seller, ``outboxd run``, an SDK buyer and receiver.

Every piece is the real thing on 127.0.0.1: ``docs/examples/adcp_seller.py`` in its own
process (the SDK's ``DecisioningPlatform`` served over MCP), the daemon process, an
``ADCPClient`` buyer, and a receiver built on the SDK's ``WebhookReceiver`` that verifies
each delivery against the JWKS the seller serves; and the TypeScript ``@adcp/sdk``'s
conformance runner, an AdCP 3.0 buyer with its own receiver and verifier. One SQLite file
(the default database) is shared by the seller and the daemon, as in docs/sdk.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select, text

from outbox.config import load_settings
from outbox.db import make_engine
from outbox.schema import messages
from tests import adcp_schema, procs, ts_sdk
from tests.procs import free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "adcp_seller.py"
BOOT_SECONDS = 600  # a bound: the SDK import and MCP schema build take ~40 s of CPU, far longer on a loaded box
HORIZON = 172_800  # not the default, so an advertised 86400 could not pass by accident


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The seller and the daemon, sharing one SQLite database and one signing key; booted
    once (the SDK's start-up is most of each test), so each test reads only the rows of its
    own buyer. Session-scoped: the storyboard below runs against it while other tests go on."""
    tmp_path = tmp_path_factory.mktemp("stack")
    key, _ = procs.make_key(tmp_path)
    database_url = f"sqlite:///{tmp_path / 'seller.db'}"
    env = procs.daemon_env(database_url, key, retry_horizon_seconds=HORIZON)
    for tuned in ("OUTBOX_RETRY_BASE_SECONDS", "OUTBOX_RETRY_MAX_SECONDS"):
        del env[tuned]  # the default retry schedule: the conformance storyboard grades it
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    port = free_port()
    seller_log = open(tmp_path / "seller.log", "wb")
    seller = subprocess.Popen([sys.executable, str(EXAMPLE), "--port", str(port)], env=env, cwd=tmp_path,
                              stdout=seller_log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    daemon = None
    try:
        up = procs.wait_until(lambda: seller.poll() is not None or _serves(f"{base}/outboxd/jwks.json"),
                              BOOT_SECONDS, interval=0.5)
        assert up and seller.poll() is None, (tmp_path / "seller.log").read_text()[-3000:]
        daemon = procs.start_daemon(env, tmp_path / "daemon.log")  # after the seller created the tables
        yield {"base": base, "env": env, "engine": make_engine(database_url), "tmp": tmp_path}
    finally:
        if daemon is not None:
            assert procs.stop(daemon) == 0
        seller.kill()
        seller.wait()
        seller_log.close()


def _serves(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class Receiver:
    """A buyer's webhook endpoint on the SDK's ``WebhookReceiver``, in a thread of this process."""

    def __init__(self, jwks_uri: str, horizon_seconds: int) -> None:
        import uvicorn
        from adcp.server.idempotency import MemoryBackend, WebhookDedupStore
        from adcp.signing import CachingJwksResolver
        from adcp.webhooks import WebhookReceiver, WebhookReceiverConfig, WebhookVerifyOptions
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route

        self.received: list[dict[str, Any]] = []
        self.rejected: list[str] = []
        receiver = WebhookReceiver(WebhookReceiverConfig(
            verify_options=WebhookVerifyOptions(jwks_resolver=CachingJwksResolver(jwks_uri, allow_private=True)),
            dedup=WebhookDedupStore(MemoryBackend(), ttl_seconds=horizon_seconds),
            receiver_scope="test-buyer",
            publisher_scope_for=lambda _signer: "example-seller",
        ))

        async def hook(request: Request) -> Response:
            body = await request.body()
            outcome = await receiver.receive_and_process(
                method=request.method, url=str(request.url), headers=dict(request.headers), body=body,
                handler=lambda _payload: self.received.append(json.loads(body)))
            if outcome.rejected:
                self.rejected.append(str(outcome.rejection_reason))
                return Response(status_code=outcome.http_status or 400, headers=dict(outcome.response_headers))
            return Response(status_code=outcome.http_status or 200)

        self.port = free_port()
        config = uvicorn.Config(Starlette(routes=[Route("/hooks", hook, methods=["POST"])]), host="127.0.0.1",
                                port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        assert procs.wait_until(lambda: self.server.started, 30, interval=0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def media_buy_request(hook_url: str, operation_id: str | None, budget: float) -> Any:
    from adcp import CreateMediaBuyRequest

    start = datetime.now(timezone.utc) + timedelta(days=1)
    return CreateMediaBuyRequest.model_validate({
        "idempotency_key": str(uuid.uuid4()),
        "account": {"account_id": "acct_1"},
        "brand": {"domain": "buyer.example"},
        "start_time": start.isoformat(), "end_time": (start + timedelta(days=30)).isoformat(),
        "total_budget": {"amount": budget, "currency": "USD"},
        "packages": [{"product_id": "prod_display", "pricing_option_id": "cpm_usd", "budget": budget}],
        "push_notification_config": {"url": hook_url, "token": "buyer-token-0123456789",
                                     **({"operation_id": operation_id} if operation_id else {})},
        "context": {"trace": operation_id or "none"},
    })


async def buy(base: str, hook_url: str) -> tuple[Any, Any, Any, Any]:
    """Capabilities, one media buy within the inventory, one over it (which must roll back),
    and one whose webhook registration lacks the operation_id AdCP 3.1+ requires."""
    from adcp import ADCPClient, AgentConfig

    async with ADCPClient(AgentConfig(id="example-seller", agent_uri=f"{base}/mcp", protocol="mcp")) as client:
        capabilities = await client.fetch_capabilities()
        booked = await client.create_media_buy(media_buy_request(hook_url, "op_booked", 5_000.0))
        refused = await client.create_media_buy(media_buy_request(hook_url, "op_refused", 1_000_000.0))
        anonymous = await client.create_media_buy(media_buy_request(hook_url, None, 1_000.0))
    return capabilities, booked.data, refused.data, anonymous


def _remaining_budget(engine: Any) -> float:
    with engine.connect() as conn:
        return float(conn.execute(text("SELECT remaining_budget FROM inventory")).scalar_one())


def test_example_seller_end_to_end(stack: dict[str, Any]) -> None:
    daemon_settings = load_settings(env=stack["env"])
    budget_before = _remaining_budget(stack["engine"])
    with Receiver(f"{stack['base']}/outboxd/jwks.json", daemon_settings.retry_horizon_seconds) as receiver:
        hook_url = f"http://127.0.0.1:{receiver.port}/hooks"
        capabilities, booked, refused, anonymous = asyncio.run(buy(stack["base"], hook_url))

        advertised = capabilities.webhook_signing
        assert advertised.supported is True
        assert advertised.delivery_retry_horizon_seconds == daemon_settings.retry_horizon_seconds == HORIZON
        assert booked.status == refused.status == "submitted", (booked, refused)
        booked_task, refused_task = booked.task_id, refused.task_id
        # This buyer speaks AdCP 3.1+: a registration without operation_id is refused, never served.
        assert not anonymous.success and "INVALID_REQUEST" in str(anonymous.adcp_error), anonymous
        assert "push_notification_config.operation_id is required" in str(anonymous.error)

        assert procs.wait_until(lambda: len(receiver.received) >= 2 or receiver.rejected, 30), \
            (stack["tmp"] / "daemon.log").read_text()[-3000:]
        time.sleep(1.0)  # anything else the daemon would send has had time to arrive
    assert receiver.rejected == []
    by_task = {body["task_id"]: body for body in receiver.received}
    assert len(receiver.received) == 2 and by_task.keys() == {booked_task, refused_task}

    completed = by_task[booked_task]
    assert (completed["status"], completed["operation_id"], completed["token"]) == \
        ("completed", "op_booked", "buyer-token-0123456789")
    assert completed["context"] == {"trace": "op_booked"}
    assert completed["result"]["packages"][0]["product_id"] == "prod_display"
    # The rolled-back transaction sent nothing: the only webhook for that task is the
    # failure the seller enqueued after the rollback.
    failed = by_task[refused_task]
    assert failed["status"] == "failed" and failed["result"]["errors"][0]["code"] == "BUDGET_EXCEEDED"
    for body in receiver.received:
        adcp_schema.assert_valid(json.dumps(body).encode())

    ours = (booked_task, refused_task)
    with stack["engine"].connect() as conn:
        rows = conn.execute(text("SELECT media_buy_id, task_id FROM media_buys WHERE task_id IN (:a, :b)"),
                            {"a": booked_task, "b": refused_task}).all()
        assert [(r.media_buy_id, r.task_id) for r in rows] == [(completed["result"]["media_buy_id"], booked_task)]
        stored = conn.execute(select(messages.c.task_id, messages.c.task_status, messages.c.state)
                              .where(messages.c.task_id.in_(ours))).all()
    assert _remaining_budget(stack["engine"]) == budget_before - 5_000.0
    assert sorted(stored) == sorted([(booked_task, "completed", "delivered"), (refused_task, "failed", "delivered")])


def test_every_delivery_report_of_a_media_buy_is_accepted_by_the_sdks_receiver(stack: dict[str, Any]) -> None:
    """The SDK's WebhookReceiver keys a finished task by its task_id: reports of one media buy
    sharing a task_id would make the second a 409 idempotency conflict, and a dead message.
    Each report is its own task by default."""
    import outbox

    settings = load_settings(env=stack["env"])
    registration = {"operation_id": "op_reports", "token": "buyer-report-token-0123456789"}
    result = {"notification_type": "scheduled", "currency": "USD", "media_buy_deliveries": [],
              "reporting_period": {"start": "2026-11-01T00:00:00Z", "end": "2026-11-02T00:00:00Z"}}
    with Receiver(f"{stack['base']}/outboxd/jwks.json", settings.retry_horizon_seconds) as receiver:
        for _ in range(3):
            with stack["engine"].begin() as conn:
                outbox.enqueue_delivery_report(
                    conn, tenant_id="reports-buyer", media_buy_id="mb_reports", result=result, settings=settings,
                    reporting_webhook={**registration, "url": f"http://127.0.0.1:{receiver.port}/hooks"})
        assert procs.wait_until(lambda: len(receiver.received) >= 3 or receiver.rejected, 30), \
            (stack["tmp"] / "daemon.log").read_text()[-3000:]
    assert receiver.rejected == []
    reports = sorted(receiver.received, key=lambda body: body["result"]["sequence_number"])
    assert [body["result"]["sequence_number"] for body in reports] == [1, 2, 3]
    assert len({body["task_id"] for body in reports}) == 3


WEBHOOK_EMISSION_STEPS = [
    "capability_discovery/get_capabilities",
    "idempotency_key_presence/trigger_webhook_operation", "idempotency_key_presence/expect_webhook_presence",
    "idempotency_key_stability/trigger_retry_scenario", "idempotency_key_stability/expect_key_stable_across_retries",
    "signature_validity/trigger_signed_webhook", "signature_validity/expect_signature_valid",
]


@pytest.fixture(scope="session")
def emission_storyboard(stack: dict[str, Any], ts_sdk_version: str) -> Iterator[Future[dict[str, Any]]]:
    """The runner's ``webhook_emission`` storyboard, started in a thread: it waits out its 90 s
    retry window whatever arrives, so it runs while the rest of the session goes on, and the
    test that grades it (marked ``session_end``) runs last."""
    base = stack["base"]
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(ts_sdk.run_storyboard, f"{base}/mcp", f"{base}/outboxd/jwks.json", "webhook_emission")


@pytest.fixture(scope="module", autouse=True)
def _storyboard_starts_first(request: pytest.FixtureRequest) -> None:
    if any(item.get_closest_marker("session_end") and item.module is request.module
           for item in request.session.items):
        request.getfixturevalue("emission_storyboard")


@pytest.mark.session_end
def test_typescript_sdk_webhook_emission_storyboard(stack: dict[str, Any],
                                                    emission_storyboard: Future[dict[str, Any]]) -> None:
    """The TypeScript SDK's conformance runner (AdCP 3.0.6) against the example seller and
    ``outboxd run``: every step of ``webhook_emission`` passes, the signature step included."""
    result = emission_storyboard.result(timeout=ts_sdk.STORYBOARD_SECONDS)
    grades = ts_sdk.step_grades(result)
    assert list(grades) == WEBHOOK_EMISSION_STEPS and set(grades.values()) == {"passed"}, \
        (grades, (stack["tmp"] / "daemon.log").read_text()[-3000:])
    failed = [v for p in result["phases"] for s in p["steps"] for v in s.get("validations", []) if not v["passed"]]
    assert failed == []
    # A 3.0 buyer registers no operation_id (the runner keeps its own in the URL path): the
    # seller sends none rather than parse the URL. One webhook per trigger, the one the
    # runner answered 503 three times delivered on its fourth attempt.
    def rows() -> list[Any]:  # the other test's buyer registers operation ids
        with stack["engine"].connect() as conn:
            return conn.execute(select(messages.c.operation_id, messages.c.state, messages.c.attempts)
                                .where(messages.c.operation_id.is_(None))).all()

    # The runner grades the last webhook as it arrives and exits: the daemon may not have
    # recorded the 200 yet (its completer flushes outcomes in rounds, tens of milliseconds).
    procs.wait_until(lambda: all(r.state != "in_flight" for r in rows()), 10)
    assert sorted(rows(), key=lambda r: r.attempts) == [(None, "delivered", 1), (None, "delivered", 1),
                                                        (None, "delivered", 4)]
