"""The operator's side, against real PostgreSQL and a real daemon: CLI, metrics, secrets, SDK seam."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

import outbox
from outbox.schema import attempts, breakers, messages
from supervisor.cli import main
from supervisor.wire.signing import load_signing_key
from tests import procs
from tests.ledger import PRODUCER, THROWAWAY_KEY, enqueue_many, finished, loopback_producer

pytestmark = pytest.mark.e2e
HMAC_SECRET = "hmac-secret-SENTINEL-0123456789abcdef"
BEARER = "bearer-token-SENTINEL-0123456789abcdef"
BUYER_TOKEN = "buyer-token-SENTINEL-42"


def cli(capsys, monkeypatch, url: str, *args: str) -> tuple[int, str, str]:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", url)
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_replay_of_a_dead_message_arrives_with_same_bytes_and_key(pg_engine, pg_url, tmp_path, capsys, monkeypatch):
    key, jwks = procs.make_key(tmp_path)
    with procs.receiver(tmp_path, jwks) as (port, log):
        [k] = enqueue_many(pg_engine, f"http://127.0.0.1:{port}", ["/flaky/1/410"])
        daemon = procs.start_daemon(procs.daemon_env(pg_url, key), tmp_path / "d.log")
        try:
            assert procs.wait_until(lambda: finished(pg_engine, 1), 20)
            code, out, _ = cli(capsys, monkeypatch, pg_url, "list", "--state", "dead", "--json")
            [row] = json.loads(out)
            assert code == 0 and row["dead_reason"] == "gone"
            code, out, _ = cli(capsys, monkeypatch, pg_url, "replay", "--reason", "gone", "--dry-run", "--json")
            assert json.loads(out)["would_replay"] == [row["id"]]
            code, out, _ = cli(capsys, monkeypatch, pg_url, "replay", str(row["id"]))
            assert code == 0 and "replayed 1" in out
            assert procs.wait_until(lambda: len(procs.arrivals(log)) == 2 and finished(pg_engine, 1), 20)
        finally:
            procs.stop(daemon)
    first, second = procs.arrivals(log)
    assert first["key"] == second["key"] == k and first["sha256"] == second["sha256"]
    assert (first["status"], second["status"]) == (410, 200) and second["verified"]
    code, out, _ = cli(capsys, monkeypatch, pg_url, "show", k, "--json")
    shown = json.loads(out)
    assert shown["state"] == "delivered"
    assert [(a["attempt_number"], a["trigger"]) for a in shown["attempt_trail"]] == [(1, "scheduled"), (2, "replay")]


def test_status_list_show_breakers_purge_and_errors(pg_engine, pg_url, capsys, monkeypatch):
    enqueue_many(pg_engine, "http://127.0.0.1:9/hook", ["", "", ""], tenants=2)
    with pg_engine.begin() as conn:
        conn.execute(messages.update().where(messages.c.id == 1).values(state="dead", dead_reason="gone",
                                                                        finished_at=1.0, retry_until=2.0))
        conn.execute(breakers.insert().values(tenant_id="tenant-0", origin="http://127.0.0.1:9", state="open",
                                              failures=0, successes=0, trips=1, open_until=9e9, updated_at=1.0))
    code, out, _ = cli(capsys, monkeypatch, pg_url, "status", "--json")
    data = json.loads(out)
    assert code == 0 and data["messages"] == {"pending": 2, "in_flight": 0, "delivered": 0, "dead": 1}
    assert data["dead_by_reason"] == {"gone": 1} and len(data["open_breakers"]) == 1
    assert data["top_tenants_by_backlog"][0]["backlog"] == 1 and data["oldest_due_age_seconds"] >= 0
    assert cli(capsys, monkeypatch, pg_url, "status")[0] == 0
    code, out, _ = cli(capsys, monkeypatch, pg_url, "list", "--tenant", "tenant-1", "--json")
    assert [r["id"] for r in json.loads(out)] == [2]
    assert "IDEMPOTENCY_KEY" in cli(capsys, monkeypatch, pg_url, "list")[1]
    code, out, _ = cli(capsys, monkeypatch, pg_url, "show", "1", "--json")
    assert json.loads(out)["payload"]["token"] == "[redacted]"
    code, _, err = cli(capsys, monkeypatch, pg_url, "show", "nope")
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    code, out, _ = cli(capsys, monkeypatch, pg_url, "breakers", "list", "--json")
    assert json.loads(out)[0]["state"] == "open"
    assert cli(capsys, monkeypatch, pg_url, "breakers", "reset", "tenant-0@http://127.0.0.1:9")[0] == 0
    assert cli(capsys, monkeypatch, pg_url, "breakers", "reset", "bad-key")[0] == 2  # a usage error
    code, out, _ = cli(capsys, monkeypatch, pg_url, "replay", "2")
    assert "refused 2: state is pending" in out
    code, out, _ = cli(capsys, monkeypatch, pg_url, "replay", "1")
    assert "past its retry horizon" in out
    code, out, err = cli(capsys, monkeypatch, pg_url, "replay", "1", "--force", "--json")
    assert json.loads(out)["replayed"] == [1] and "warning" in err
    with pg_engine.begin() as conn:
        conn.execute(messages.update().where(messages.c.id == 1).values(state="dead", dead_reason="gone",
                                                                        finished_at=1.0, retry_until=2.0))
        conn.execute(messages.update().where(messages.c.id == 2).values(state="delivered", finished_at=1.0,
                                                                        retry_until=9e9))
    code, out, _ = cli(capsys, monkeypatch, pg_url, "purge", "--older-than", "1d", "--json")
    assert json.loads(out) == {"dry_run": False, "deleted": 1,
                               "dropped_attempt_partitions": []}  # 2: inside its horizon


def test_purge_rejects_bad_duration():
    with pytest.raises(SystemExit):
        main(["purge", "--older-than", "soon"])


def test_keys_generate(tmp_path, capsys):
    pem = tmp_path / "k.pem"
    assert main(["keys", "generate", "--alg", "es256", "--out", str(pem)]) == 0
    assert pem.stat().st_mode & 0o777 == 0o600
    assert main(["keys", "generate", "--out", str(pem)]) == 1  # refuses to overwrite
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert load_signing_key(pem, "k").alg == "ecdsa-p256-sha256"


def test_metrics_health_and_no_secret_anywhere(pg_engine, pg_url, tmp_path):
    key, jwks = procs.make_key(tmp_path)
    metrics_port = procs.free_port()
    settings = loopback_producer(OUTBOX_ENCRYPTION_KEY=THROWAWAY_KEY)
    with procs.receiver(tmp_path, jwks) as (port, log):
        base = f"http://127.0.0.1:{port}"
        with pg_engine.begin() as conn:
            for i, auth in enumerate([None, {"schemes": ["HMAC-SHA256"], "credentials": HMAC_SECRET},
                                      {"schemes": ["Bearer"], "credentials": BEARER}]):
                config = {"url": f"{base}/flaky/1?secret={BUYER_TOKEN}", "operation_id": "op",
                          "token": BUYER_TOKEN, **({"authentication": auth} if auth else {})}
                outbox.enqueue_task_webhook(conn, tenant_id="t", push_notification_config=config, task_id=f"t{i}",
                                            task_type="create_media_buy", status="completed", settings=settings)
        env = procs.daemon_env(pg_url, key, metrics_addr=f"127.0.0.1:{metrics_port}", encryption_key=THROWAWAY_KEY)
        daemon = procs.start_daemon(env, tmp_path / "d.log")
        try:
            assert procs.wait_until(lambda: finished(pg_engine, 3), 30)
            time.sleep(0.3)
            body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
            health = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/healthz", timeout=5).status
            ready = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/readyz", timeout=5).status
        finally:
            assert procs.stop(daemon) == 0
    assert health == ready == 200
    families = {f.name: f.type for f in text_string_to_metric_families(body)}
    expected = {"outbox_deliveries": "counter", "outbox_attempts": "counter",
                "outbox_attempt_duration_seconds": "histogram", "outbox_commit_to_delivery_seconds": "histogram",
                "outbox_messages": "gauge", "outbox_oldest_due_message_age_seconds": "gauge",
                "outbox_dead_letters": "counter", "outbox_breakers": "gauge",
                "outbox_breaker_transitions": "counter", "outbox_in_flight_requests": "gauge",
                "outbox_claim_batch_size": "histogram", "outbox_sink_errors": "counter", "outbox_build_info": "gauge"}
    for name, kind in expected.items():
        assert families.get(name) == kind, name
    assert 'outbox_deliveries_total{outcome="delivered"} 3.0' in body
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    # the HMAC and Bearer receivers verified nothing 9421: assert they got the legacy headers instead
    arrivals = procs.arrivals(log)
    assert sum(a["signature_input"] is None for a in arrivals) == 4  # 2 legacy messages x (503 + 200)
    with pg_engine.connect() as conn:
        rows = json.dumps([dict(r._mapping) for r in conn.execute(select(attempts))], default=str)
        stored = conn.execute(select(messages.c.auth_secret)).scalars().all()
    haystack = (tmp_path / "d.log").read_text() + body + rows
    for secret in (HMAC_SECRET, BEARER, BUYER_TOKEN, key.read_text().splitlines()[1]):
        assert secret not in haystack
        assert all(secret.encode() not in (s or b"") for s in stored)


async def test_adcp_sdk_send_mcp_through_the_seam(pg_engine, pg_url, tmp_path):
    from adcp.webhook_supervisor import WebhookDeliverySupervisor

    from outbox.db import make_async_engine
    from supervisor.sdk import OutboxWebhookSupervisor

    key, jwks = procs.make_key(tmp_path)
    engine = make_async_engine(pg_url)
    seam = OutboxWebhookSupervisor(engine, tenant_id="sdk-seller", settings=PRODUCER)
    assert isinstance(seam, WebhookDeliverySupervisor) and seam.delivery_state_is_durable
    with procs.receiver(tmp_path, jwks, verifier="adcp") as (port, log):
        assert await seam.send_mcp(url=f"http://127.0.0.1:{port}/ok", task_id="task_sdk", status="completed",
                                   task_type="create_media_buy", result={"media_buy_id": "mb"},
                                   operation_id="op_sdk", token="sdk-token-0123456789") is None
        await engine.dispose()
        daemon = procs.start_daemon(procs.daemon_env(pg_url, key), tmp_path / "d.log")
        try:
            assert procs.wait_until(lambda: finished(pg_engine, 1), 20)
        finally:
            procs.stop(daemon)
        [arrival] = procs.arrivals(log)
    assert arrival["verified"] and arrival["status"] == 200
