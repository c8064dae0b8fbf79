"""Recovery jobs: the selection and its dry run, pause / resume / cancel, the rate, and a
job of 10,000 dead messages surviving SIGKILL of its daemon with every message replayed
exactly once."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import time
from typing import Any

import pytest
from sqlalchemy import func, select, text, update

from outbox.db import make_async_engine
from outbox.schema import job_items, jobs, messages
from supervisor.cycle import job_runner as runner
from supervisor.operator import jobs as recovery
from supervisor.cycle.outage import OutageGuard
from tests import procs
from tests.ledger import enqueue_tasks


def _kill(engine, ids: list[int], reason: str, ago: float = 60.0) -> None:
    """Messages that ended dead ``ago`` seconds before now (as the daemon would leave them)."""
    clock = "extract(epoch from now())" if engine.dialect.name == "postgresql" else \
        "((julianday('now') - 2440587.5) * 86400.0)"
    with engine.begin() as conn:
        conn.execute(update(messages).where(messages.c.id.in_(ids)).values(
            state="dead", dead_reason=reason, attempts=1, finished_at=text(f"{clock} - {ago}")))


async def test_a_job_replays_its_selection_once_and_obeys_pause_resume_and_cancel(engine):
    gone = enqueue_tasks(engine, "acme", "http://127.0.0.1:9/a", 7)
    expired = enqueue_tasks(engine, "acme", "http://127.0.0.1:9/b", 3, start=10)
    other_tenant = enqueue_tasks(engine, "zeta", "http://127.0.0.1:9/a", 2)
    old = enqueue_tasks(engine, "acme", "http://127.0.0.1:9/a", 2, start=20)
    _kill(engine, gone, "gone")
    _kill(engine, expired, "expired")
    _kill(engine, other_tenant, "gone")
    _kill(engine, old, "gone", ago=7200)
    with engine.begin() as conn:  # past their horizon: replayed only with force
        conn.execute(update(messages).where(messages.c.id.in_(expired)).values(created_at=1.0))
    async_engine = make_async_engine(engine.url.render_as_string(hide_password=False))
    try:
        since = time.time() - 3600
        async with async_engine.begin() as conn:
            everything = recovery.Selection("acme", since)
            assert await recovery.count(conn, everything) == 10
            assert await recovery.count(conn, recovery.Selection("acme", since, reason="expired")) == 3
            assert await recovery.count(conn, recovery.Selection("acme", since, origin="http://127.0.0.1:9")) == 10
            job = await recovery.create(conn, everything, force=False, rate=4)
            assert await recovery.change(conn, job["id"], "pause")
            assert not await recovery.change(conn, job["id"], "pause")  # already paused
        run = {"daemon_id": "d1", "horizon_seconds": 86_400}
        assert await runner.run_chunk(async_engine, job["id"], **run) is None  # paused: nothing
        async with async_engine.begin() as conn:
            assert await recovery.change(conn, job["id"], "resume")
        assert await runner.run_chunk(async_engine, job["id"], **run) == 4  # the rate bounds a chunk
        assert await runner.run_chunk(async_engine, job["id"], daemon_id="d2", horizon_seconds=86_400) is None
        _kill(engine, gone[:2], "gone", ago=1)  # replayed, then dead again: not the job's to take twice
        while (handled := await runner.run_chunk(async_engine, job["id"], **run)) != 0:
            assert handled
        async with async_engine.begin() as conn:
            done = await recovery.show(conn, job["id"])
            forced = await recovery.create(conn, recovery.Selection("acme", since, reason="expired"), force=True,
                                           rate=100)
            cancelled = await recovery.create(conn, everything, force=False, rate=100)
            assert await recovery.change(conn, cancelled["id"], "cancel")
            assert not await recovery.change(conn, cancelled["id"], "resume")
        assert await runner.run_chunk(async_engine, forced["id"], **run) == 3
        assert await runner.run_chunk(async_engine, cancelled["id"], **run) is None
    finally:
        await async_engine.dispose()
    assert (done["state"], done["total"], done["done"], done["skipped"], done["remaining"]) == ("done", 10, 7, 3, 0)
    with engine.connect() as conn:
        items = conn.execute(select(job_items.c.job_id, job_items.c.message_id)).all()
        states = dict(conn.execute(select(messages.c.id, messages.c.state)).all())
    assert sorted(m for j, m in items if j == job["id"]) == sorted(gone)
    assert sorted(m for j, m in items if j == forced["id"]) == sorted(expired)
    assert all(states[i] == "dead" for i in other_tenant + old)


async def _dead_and_a_job(engine, tenant: str, n: int, *, rate: float) -> tuple[list[int], Any, dict[str, Any]]:
    """``n`` of ``tenant``'s messages dead a minute ago, an async engine, and a job replaying them."""
    ids = enqueue_tasks(engine, tenant, "http://127.0.0.1:9/a", n)
    _kill(engine, ids, "gone")
    async_engine = make_async_engine(engine.url.render_as_string(hide_password=False))
    async with async_engine.begin() as conn:
        job = await recovery.create(conn, recovery.Selection(tenant, time.time() - 3600), force=False, rate=rate)
    return ids, async_engine, job


async def test_a_finished_job_accounts_for_messages_that_left_its_selection(engine):
    """Counted at the start, then replayed by hand before the job reached them: the finished
    job says so, rather than ending "3/6 replayed" with nothing skipped and nothing remaining."""
    dead, async_engine, job = await _dead_and_a_job(engine, "rj", 6, rate=100)
    try:
        with engine.begin() as conn:  # an operator replays three of them meanwhile
            conn.execute(update(messages).where(messages.c.id.in_(dead[:3])).values(state="pending", dead_reason=None,
                                                                                   finished_at=None))
        while await runner.run_chunk(async_engine, job["id"], daemon_id="d1", horizon_seconds=86_400):
            pass
        async with async_engine.begin() as conn:
            done = await recovery.show(conn, job["id"])
    finally:
        await async_engine.dispose()
    assert (done["state"], done["done"], done["skipped"], done["left"], done["remaining"]) == ("done", 3, 0, 3, 0)


async def test_the_runner_keeps_to_the_rate(pg_engine):
    ids, async_engine, job = await _dead_and_a_job(pg_engine, "acme", 30, rate=10)
    try:
        running = asyncio.create_task(runner.JobRunner(async_engine, daemon_id="d", horizon_seconds=86_400,
                                                       outage=OutageGuard(30)).run())
        started = time.monotonic()
        try:
            while True:
                async with async_engine.connect() as conn:
                    if (await recovery.show(conn, job["id"]))["state"] == "done":
                        break
                assert time.monotonic() - started < 60
                await asyncio.sleep(0.05)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
    finally:
        await async_engine.dispose()
    assert time.monotonic() - started >= 2.0  # 30 messages at 10/s: three chunks, two pauses of a second


@pytest.mark.e2e
def test_a_job_of_10000_survives_sigkill_and_replays_each_message_once(pg_engine, pg_url, tmp_path):
    key, jwks = procs.make_key(tmp_path)
    with procs.receiver(tmp_path, None) as (port, log):
        [first] = enqueue_tasks(pg_engine, "acme", f"http://127.0.0.1:{port}/ok", 1)
        with pg_engine.begin() as conn:  # 9,999 more like it, each its own key (cheaper than 9,999 enqueues)
            conn.execute(text("""
                INSERT INTO outbox_messages (tenant_id, url, origin, idempotency_key, body, body_sha256, auth_mode,
                                             task_id, task_type, task_status, notification_type, operation_id)
                SELECT m.tenant_id, m.url, m.origin, k.key,
                       convert_to(replace(convert_from(m.body, 'UTF8'), m.idempotency_key, k.key), 'UTF8'),
                       sha256(convert_to(replace(convert_from(m.body, 'UTF8'), m.idempotency_key, k.key), 'UTF8')),
                       m.auth_mode, m.task_id, m.task_type, m.task_status, m.notification_type, m.operation_id
                FROM outbox_messages AS m,
                     LATERAL (SELECT 'whk_recover_' || lpad(g::text, 8, '0') AS key FROM generate_series(2, 10000) g) k
                WHERE m.id = :first"""), {"first": first})
            ids = list(conn.execute(select(messages.c.id)).scalars())
        assert len(ids) == 10_000
        _kill(pg_engine, ids, "gone")
        env = procs.daemon_env(pg_url, key)
        dry = procs.outboxd(env, "recover", "start", "--tenant", "acme", "--since", "1h", "--dry-run", "--json")
        assert dry.returncode == 0 and json.loads(dry.stdout) == {"would_replay": 10_000}, dry.stderr
        # a rate well above the default keeps the test short; the rate is tested above
        made = procs.outboxd(env, "recover", "start", "--tenant", "acme", "--since", "1h", "--rate", "1500", "--json",
                             exit_code=0)
        job_id = json.loads(made.stdout)["id"]

        def progress() -> dict:
            with pg_engine.connect() as conn:
                return dict(conn.execute(select(jobs).where(jobs.c.id == job_id)).one()._mapping)

        daemon = procs.start_daemon(env, tmp_path / "d1.log")
        try:
            assert procs.wait_until(lambda: progress()["done"] >= 2_000, 120)
        finally:
            procs.stop(daemon, signal.SIGKILL)
        at_kill = progress()["done"]
        assert at_kill < 10_000, "the job finished before the kill: nothing was resumed"
        daemon = procs.start_daemon(env, tmp_path / "d2.log")
        try:
            assert procs.wait_until(lambda: progress()["state"] == "done", 180)

            def all_delivered() -> bool:
                with pg_engine.connect() as conn:
                    return conn.execute(select(func.count()).where(messages.c.state != "delivered")).scalar() == 0
            assert procs.wait_until(all_delivered, 240)
        finally:
            assert procs.stop(daemon) == 0
        shown = procs.outboxd(env, "recover", "show", str(job_id))
    job = progress()
    with pg_engine.connect() as conn:
        replays = collections.Counter(conn.execute(select(job_items.c.message_id).where(
            job_items.c.job_id == job_id)).scalars())
    print(f"\nkilled at {at_kill}/10000 replayed; resumed to {job['done']}")
    assert (job["done"], job["skipped"], job["total"]) == (10_000, 0, 10_000)
    assert set(replays) == set(ids) and set(replays.values()) == {1}  # every message, each exactly once
    assert {a["key"] for a in procs.arrivals(log)} >= {f"whk_recover_{i:08d}" for i in range(2, 10_001)}
    assert shown.returncode == 0 and "replayed 10000/10000" in shown.stdout
