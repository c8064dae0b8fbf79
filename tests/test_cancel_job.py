"""Cancel-pending recovery jobs: the enqueue-time range and its dry run, and a job over 2,000
pending messages to a hanging endpoint, its daemon killed with SIGKILL mid-way and another
resuming it, on both databases: each matching message ends ``cancelled`` exactly once, the
ones in flight when the job reached them are skipped and counted, nothing of another tenant
or endpoint is touched, and a replay refuses what was cancelled."""

from __future__ import annotations

import collections
import json
import signal
import time

import pytest
from sqlalchemy import func, select, update

from outbox.db import make_async_engine
from outbox.schema import endpoint_stats, job_items, jobs, messages
from supervisor.observe.metrics import Metrics
from supervisor.cycle import job_runner as runner
from supervisor.operator import jobs as recovery
from tests import procs
from tests.ledger import enqueue_tasks

HELD = 2_000


async def test_a_cancel_job_takes_pending_messages_of_its_range_and_leaves_in_flight_ones(engine):
    early = enqueue_tasks(engine, "acme", "http://127.0.0.1:9/a", 3)
    late = enqueue_tasks(engine, "acme", "http://127.0.0.1:9/a", 4, start=10)
    elsewhere = enqueue_tasks(engine, "acme", "http://127.0.0.1:8/b", 2, start=20)
    other_tenant = enqueue_tasks(engine, "zeta", "http://127.0.0.1:9/a", 2)
    with engine.begin() as conn:  # enqueued an hour ago; one of the late ones leased by a daemon now
        conn.execute(update(messages).where(messages.c.id.in_(early)).values(created_at=time.time() - 3600))
        conn.execute(update(messages).where(messages.c.id == late[0]).values(
            state="in_flight", lease_token="a-daemon's", lease_expires_at=time.time() + 60, leased_by="d0"))
    aengine = make_async_engine(engine.url.render_as_string(hide_password=False))
    try:
        since = time.time() - 600
        recent = recovery.Selection("acme", since, "http://127.0.0.1:9", kind="cancel")
        async with aengine.begin() as conn:
            assert await recovery.count(conn, recent) == 4  # the in-flight one counts: it may be pending when reached
            assert await recovery.count(conn, recovery.Selection("acme", 0.0, kind="cancel")) == 9
            assert await recovery.count(conn, recovery.Selection("acme", 0.0, kind="cancel", until=since)) == 3
            job = await recovery.create(conn, recent, force=False, rate=2)
        metrics = Metrics(per_tenant=True)
        run = {"daemon_id": "d1", "horizon_seconds": 86_400, "metrics": metrics}
        leases = []
        while (handled := await runner.run_chunk(aengine, job["id"], **run)) != 0:
            assert handled is not None
            with engine.connect() as conn:
                leases.append(conn.execute(select(jobs.c.lease_until - jobs.c.updated_at)
                                           .where(jobs.c.id == job["id"])).scalar_one())
        async with aengine.connect() as conn:
            done = await recovery.show(conn, job["id"])
            # what was cancelled is never replayed, nor selected by a replay job, forced or not
            assert await recovery.count(conn, recovery.Selection("acme", 0.0)) == 0
            assert await recovery.count(conn, recovery.Selection("acme", 0.0, reason="cancelled")) == 0
    finally:
        await aengine.dispose()
    assert (done["kind"], done["state"], done["total"], done["done"], done["skipped"]) == ("cancel", "done", 4, 3, 1)
    # held through the pause its rate (2 a second, chunks of 2) puts before the next chunk
    assert leases and all(abs(lease - (recovery.LEASE_SECONDS + 1.0)) < 0.01 for lease in leases), leases
    # deaths like any other: the dead-letter counter, the final outcomes, the endpoint's rollup
    sample = metrics.registry.get_sample_value
    assert sample("outbox_dead_letters_total", {"reason": "cancelled"}) == 3
    assert sample("outbox_deliveries_total", {"outcome": "dead", "tenant": "acme"}) == 3
    with engine.connect() as conn:
        assert conn.execute(select(func.sum(endpoint_stats.c.deaths)).where(
            endpoint_stats.c.tenant_id == "acme", endpoint_stats.c.origin == "http://127.0.0.1:9")).scalar_one() == 3
    with engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(select(messages))}
    assert all((rows[i].state, rows[i].dead_reason) == ("dead", "cancelled") for i in late[1:])
    assert all(rows[i].last_error == f"cancelled by recovery job {job['id']}" for i in late[1:])
    assert rows[late[0]].state == "in_flight" and rows[late[0]].lease_token == "a-daemon's"
    assert all(rows[i].state == "pending" for i in early + elsewhere + other_tenant)


@pytest.mark.e2e
def test_a_cancel_job_of_2000_survives_sigkill_and_cancels_each_message_once(engine, tmp_path):
    key, _ = procs.make_key(tmp_path)
    url = engine.url.render_as_string(hide_password=False)
    # The daemon's defaults for the timeouts: a hanging request stays in flight ten seconds.
    env = procs.daemon_env(url, key, read_timeout_seconds=10, lease_seconds=30)
    with procs.receiver(tmp_path, None, name="held") as (held_port, _), \
            procs.receiver(tmp_path, None, name="ok") as (ok_port, ok_log):
        held, ok = f"http://127.0.0.1:{held_port}", f"http://127.0.0.1:{ok_port}"
        matching = enqueue_tasks(engine, "acme", f"{held}/hang", HELD)
        other_origin = enqueue_tasks(engine, "acme", f"{ok}/ok", 20, start=HELD)
        other_tenant = enqueue_tasks(engine, "zeta", f"{held}/hang", 20)

        def count(*where) -> int:
            with engine.connect() as conn:
                return conn.execute(select(func.count()).select_from(messages).where(*where)).scalar_one()

        def progress() -> dict:
            with engine.connect() as conn:
                return dict(conn.execute(select(jobs).order_by(jobs.c.id.desc()).limit(1)).one()._mapping)

        daemon = procs.start_daemon(env, tmp_path / "d1.log")
        try:
            assert procs.wait_until(lambda: count(messages.c.id.in_(matching), messages.c.state == "in_flight"), 60)
            dry = procs.outboxd(env, "recover", "start", "--cancel-pending", "--tenant", "acme", "--origin", held,
                           "--dry-run", "--json")
            assert dry.returncode == 0 and json.loads(dry.stdout) == {"would_cancel": HELD}, dry.stderr
            # a rate above the default keeps the test short; the rate is tested with the replay jobs
            made = procs.outboxd(env, "recover", "start", "--cancel-pending", "--tenant", "acme", "--origin", held,
                            "--rate", "200", "--json", exit_code=0)
            job_id = json.loads(made.stdout)["id"]
            assert procs.wait_until(lambda: progress()["done"] >= 400, 120)
        finally:
            procs.stop(daemon, signal.SIGKILL)
        at_kill = progress()
        assert at_kill["done"] + at_kill["skipped"] < HELD, "the job finished before the kill: nothing was resumed"
        daemon = procs.start_daemon(env, tmp_path / "d2.log")
        try:
            assert procs.wait_until(lambda: progress()["state"] == "done", 180)
            assert procs.wait_until(lambda: len(procs.arrivals(ok_log)) >= 20, 60)
        finally:
            assert procs.stop(daemon) == 0
        shown = procs.outboxd(env, "recover", "show", str(job_id))
        cancelled_one = sorted(matching)[-1]
        refused = procs.outboxd(env, "replay", str(cancelled_one))
    job = progress()
    with engine.connect() as conn:
        items = collections.Counter(conn.execute(select(job_items.c.message_id).where(
            job_items.c.job_id == job_id)).scalars())
        rows = {r.id: r for r in conn.execute(select(messages))}
    print(f"\nkilled at {at_kill['done']}/{HELD} cancelled; resumed to {job['done']}, "
          f"{job['skipped']} in flight skipped")
    assert job["total"] == HELD and job["done"] + job["skipped"] == HELD and job["skipped"] >= 1
    assert set(items.values()) == {1} and len(items) == job["done"]  # each at most once, by the database's key
    cancelled = {i for i in matching if (rows[i].state, rows[i].dead_reason) == ("dead", "cancelled")}
    assert cancelled == set(items)  # every cancelled message is the job's, recorded once
    assert all(rows[i].last_error == f"cancelled by recovery job {job_id}" for i in cancelled)
    skipped = set(matching) - cancelled
    assert len(skipped) == job["skipped"] and all(rows[i].first_attempt_at for i in skipped)  # each was claimed
    assert all(rows[i].dead_reason != "cancelled" for i in other_origin + other_tenant)
    assert all(rows[i].state == "delivered" for i in other_origin)
    assert cancelled_one in cancelled, "the newest message was in flight: pick a cancelled one"
    assert refused.returncode == 1 and "it was cancelled" in refused.stdout, refused.stdout
    assert shown.returncode == 0 and f"cancelled {job['done']}/{HELD}" in shown.stdout


@pytest.mark.parametrize("engine", ["sqlite"], indirect=True)
def test_recover_start_refuses_options_that_do_not_fit_a_cancel_job(engine, tmp_path):
    env = procs.daemon_env(engine.url.render_as_string(hide_password=False), procs.make_key(tmp_path)[0])
    for args, words in ((["--cancel-pending", "--reason", "gone"], "--cancel-pending takes pending ones"),
                        (["--cancel-pending", "--force"], "--cancel-pending takes pending ones"),
                        (["--cancel-pending", "--since", "1h", "--until", "2h"], "--until is before --since"),
                        (["--since", "1h", "--until", "1m"], "--until bounds --cancel-pending"),
                        (["--since", "1h", "--cancel-pending", "--until", "whenever"], "neither an ISO 8601 time")):
        answer = procs.outboxd(env, "recover", "start", "--tenant", "acme", *args)
        assert answer.returncode != 0 and words in answer.stderr, (args, answer.stderr)
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(jobs)).scalar_one() == 0
    counted = procs.outboxd(env, "recover", "start", "--cancel-pending", "--tenant", "acme", "--dry-run")
    assert counted.returncode == 0 and counted.stdout.strip() == "would cancel 0 pending or in-flight message(s)"
