"""Webhook bodies sealed at rest: no plaintext token in the database, exact bytes on the wire."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import update
from sqlalchemy.engine import make_url

import outbox
from outbox.config import ConfigurationError
from outbox.db import libpq_url
from outbox.schema import messages
from outbox.sealing import KeyUnavailable, SealError, key_id, plaintext
from supervisor.cycle.attempt import opened
from tests import stored
from tests.ledger import loopback_producer

TOKEN = "buyer-token-PLAINTEXT-canary-0042"
CONTEXT_SECRET = TOKEN[::-1]  # what enqueue_all_kinds puts in the (buyer-private) context
CREDENTIAL = "legacy-bearer-PLAINTEXT-canary-0123456789"
PNC = {"url": "https://buyer.example.com/hooks", "operation_id": "op_1", "token": TOKEN}


def new_key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


def sealing_settings(active: str | None, *older: str) -> outbox.Settings:
    env: dict[str, str] = {}
    if active:
        env["OUTBOX_ENCRYPTION_KEY"] = active
    if older:
        env["OUTBOX_ENCRYPTION_OLD_KEYS"] = ",".join(older)
    return loopback_producer(**env)


def enqueue_all_kinds(engine, settings, token: str = TOKEN) -> list[int]:
    """One message of each producer function, each carrying ``token`` (and a private context)."""
    pnc = {**PNC, "token": token}
    with engine.begin() as conn:
        ids = [
            outbox.enqueue_task_webhook(conn, tenant_id="t1", push_notification_config=pnc, task_id="task_1",
                                        task_type="create_media_buy", status="completed",
                                        result={"media_buy_id": "mb_1"}, context={"note": token[::-1]},
                                        settings=settings).id,
            outbox.enqueue_delivery_report(conn, tenant_id="t1", reporting_webhook=pnc, media_buy_id="mb_1",
                                           result={"notification_type": "scheduled", "media_buy_deliveries": []},
                                           settings=settings).id,
            outbox.enqueue(conn, tenant_id="t1", url=pnc["url"], settings=settings,
                           payload={"event": "creative.status_changed", "token": token}).id,
        ]
        if settings.sealing() is not None:
            ids.append(outbox.enqueue(
                conn, tenant_id="t1", url=pnc["url"], settings=settings, payload={"event": "x", "token": token},
                authentication={"schemes": ["Bearer"], "credentials": CREDENTIAL}).id)
    return ids


def raw_table_bytes(engine) -> bytes:
    """Every byte the database keeps on disk for the outbox tables (heap, TOAST, WAL for SQLite)."""
    if engine.dialect.name == "sqlite":
        path = Path(make_url(str(engine.url)).database)
        engine.dispose()
        return b"".join(p.read_bytes() for p in (path, Path(f"{path}-wal")) if p.exists())
    url = libpq_url(engine.url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CHECKPOINT")
        data_dir = Path(conn.execute("SHOW data_directory").fetchone()[0])
        files = conn.execute(
            "SELECT pg_relation_filepath(c.oid) FROM pg_class c WHERE c.relname = 'outbox_messages' "
            "UNION ALL SELECT pg_relation_filepath(c.reltoastrelid) FROM pg_class c "
            "WHERE c.relname = 'outbox_messages' AND c.reltoastrelid <> 0").fetchall()
    return b"".join((data_dir / f).read_bytes() for (f,) in files if (data_dir / f).exists())


def test_the_database_holds_no_plaintext_secret(engine):
    plain = enqueue_all_kinds(engine, sealing_settings(None), token="plaintext-row-token-control-1")
    control = raw_table_bytes(engine)
    # The search can fail: the row written without a key shows its token in the raw bytes.
    assert b"plaintext-row-token-control-1" in control
    settings = sealing_settings(new_key())
    ids = enqueue_all_kinds(engine, settings)
    raw = raw_table_bytes(engine)
    for secret in (TOKEN, CONTEXT_SECRET, CREDENTIAL):
        assert secret.encode() not in raw, f"{secret} is stored in plaintext"
    for message_id in ids:
        row = stored.row(engine, message_id)
        assert row.body_key_id == settings.sealing().active_id
        assert row.body_sha256 == hashlib.sha256(bytes(row.body)).digest()
        body = json.loads(stored.body(engine, message_id, settings))
        assert body["token"] == TOKEN
    assert all(stored.row(engine, i).body_key_id is None for i in plain)


def test_a_sealed_body_does_not_open_on_another_row(engine):
    settings = sealing_settings(new_key())
    first, second = enqueue_all_kinds(engine, settings)[:2]
    moved = stored.row(engine, first)
    with engine.begin() as conn:
        conn.execute(update(messages).where(messages.c.id == second)
                     .values(body=moved.body, body_sha256=moved.body_sha256))
    with pytest.raises(SealError, match="moved from another row"):
        plaintext(stored.row(engine, second), settings.sealing())
    assert json.loads(plaintext(stored.row(engine, first), settings.sealing()))["token"] == TOKEN


def test_an_identical_retry_is_idempotent_and_a_changed_one_conflicts(engine):
    settings = sealing_settings(new_key())
    args = dict(tenant_id="t1", push_notification_config=PNC, task_id="task_1", task_type="create_media_buy",
                status="completed", result={"media_buy_id": "mb_1"}, settings=settings)
    with engine.begin() as conn:
        raw = b'{"idempotency_key":"whk_sealed_retry_00000001","event":"x","token":"' + TOKEN.encode() + b'"}'
        first = outbox.enqueue(conn, tenant_id="t1", url=PNC["url"], payload=raw, settings=settings)
        assert outbox.enqueue(conn, tenant_id="t1", url=PNC["url"], payload=raw, settings=settings) == first
        with pytest.raises(outbox.IdempotencyConflictError):
            outbox.enqueue(conn, tenant_id="t1", url=PNC["url"], payload=raw.replace(b'"x"', b'"y"'),
                           settings=settings)
        assert outbox.enqueue_task_webhook(conn, idempotency_key="whk_sealed_task_00000001", **args).id > 0


def test_the_daemon_opens_only_with_a_configured_key(engine):
    old, new = new_key(), new_key()
    [message_id] = enqueue_all_kinds(engine, sealing_settings(old))[:1]
    from outbox.leases import Claimed

    row = stored.row(engine, message_id)
    claimed = Claimed(id=row.id, tenant_id=row.tenant_id, url=row.url, origin=row.origin,
                      idempotency_key=row.idempotency_key, body=bytes(row.body), body_sha256=bytes(row.body_sha256),
                      auth_mode=row.auth_mode, auth_secret=None, sequence_number=None, notification_type=None,
                      attempt=1, retry_until=2e9, created_at=1e9, trigger="scheduled", claimed_at=1.7e9,
                      lease_token="x", body_key_id=row.body_key_id)
    assert json.loads(opened(claimed, sealing_settings(new, old)).body)["token"] == TOKEN
    with pytest.raises(KeyUnavailable, match=f"sealed under key {key_id(base64.b64decode(old))}"):
        opened(claimed, sealing_settings(new))
    with pytest.raises(KeyUnavailable, match="OUTBOX_ENCRYPTION_KEY is not set"):
        opened(claimed, sealing_settings(None))


def test_old_keys_setting_is_validated_with_one_line():
    with pytest.raises(ConfigurationError, match="OUTBOX_ENCRYPTION_OLD_KEYS"):
        sealing_settings(new_key(), "not-base64!")
    settings = sealing_settings(new_key(), new_key(), new_key())
    assert len(settings.sealing().ids) == 3


def test_cli_show_and_status_never_print_a_secret(pg_engine, pg_url, monkeypatch, capsys):
    from supervisor.cli import main

    key = new_key()
    enqueue_all_kinds(pg_engine, sealing_settings(key))
    monkeypatch.setenv("OUTBOX_DATABASE_URL", pg_url)
    monkeypatch.setenv("OUTBOX_ENCRYPTION_KEY", key)
    outputs = []
    for args in (["show", "1", "--json"], ["show", "4"], ["list", "--json"], ["status"],
                 ["encryption", "status", "--json"]):
        assert main(args) == 0
        outputs.append(capsys.readouterr().out)
    everything = "\n".join(outputs)
    for secret in (TOKEN, CREDENTIAL):  # the context is the operator's to read; credentials never
        assert secret not in everything
    assert json.loads(outputs[0])["payload"]["token"] == "[redacted]"
    [entry] = [e for e in json.loads(outputs[-1])["keys"] if e["key_id"] == key_id(base64.b64decode(key))]
    assert entry["configured"]
    assert entry["rows"] == {"message bodies": 4, "message credentials": 1}
    monkeypatch.delenv("OUTBOX_ENCRYPTION_KEY")
    assert main(["status"]) == 1  # sealed messages this configuration cannot open are held
    shown = capsys.readouterr().out
    assert "stored in plaintext" in shown and "HELD       4 message(s)" in shown


async def test_reseal_moves_every_row_onto_the_active_key(engine):
    from outbox.db import make_async_engine
    from supervisor.cycle.resealer import reseal_all

    old, new = new_key(), new_key()
    plain = enqueue_all_kinds(engine, sealing_settings(None), token="plaintext-written-token-000001")
    sealed = enqueue_all_kinds(engine, sealing_settings(old))
    rotated = sealing_settings(new, old)
    expected = {i: stored.body(engine, i, sealing_settings(old)) for i in sealed}
    expected.update({i: stored.body(engine, i, sealing_settings(None)) for i in plain})
    async_engine = make_async_engine(str(engine.url.render_as_string(hide_password=False)))
    try:
        count, failed = await reseal_all(async_engine, rotated.sealing(), batch=2)
        assert (count, failed) == (len(plain) + len(sealed), [])
        assert await reseal_all(async_engine, rotated.sealing()) == (0, [])
    finally:
        await async_engine.dispose()
    for message_id, body in expected.items():
        assert stored.row(engine, message_id).body_key_id == rotated.sealing().active_id
        assert stored.body(engine, message_id, sealing_settings(new)) == body  # the old key is no longer needed
    credential_row = stored.row(engine, sealed[-1])
    from outbox.sealing import CREDENTIAL as PURPOSE

    assert sealing_settings(new).sealing().open(PURPOSE, bytes(credential_row.auth_secret), tenant_id="t1",
                                                idempotency_key=credential_row.idempotency_key) == CREDENTIAL.encode()


def test_concurrent_async_enqueues_of_a_new_process_never_block_its_event_loop(pg_url, tmp_path):
    """The first enqueues of a seller process read the agreed encryption key; under
    outbox.aio, coroutines of one thread did so behind a thread lock one of them held while
    suspended, and the event loop froze for good. In a fresh interpreter (no agreement read
    yet), twenty enqueues at once must finish, and a ticker must keep ticking meanwhile."""
    import base64
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "seller.py"
    script.write_text(f"""
import asyncio
import outbox
from outbox import aio
from outbox.db import make_async_engine

async def main():
    engine = make_async_engine({pg_url!r})
    ticks = []

    async def ticker():
        while True:
            ticks.append(1)
            await asyncio.sleep(0.01)

    async def enqueue(i):
        async with engine.begin() as conn:
            await aio.enqueue(conn, tenant_id="t", url="https://buyer.example.com/hook", payload={{"n": i}})

    tick = asyncio.create_task(ticker())
    await asyncio.wait_for(asyncio.gather(*(enqueue(i) for i in range(20))), 30)
    tick.cancel()
    await engine.dispose()
    print("enqueued", len(ticks) > 0)

asyncio.run(main())
""")
    env = {**os.environ, "OUTBOX_DATABASE_URL": pg_url, "OUTBOX_ENCRYPTION_KEY": base64.b64encode(os.urandom(32)).decode(),
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    try:
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("the seller's event loop froze: 20 concurrent sealed enqueues never finished")
    assert done.returncode == 0 and done.stdout.strip() == "enqueued True", done.stderr[-2000:]
