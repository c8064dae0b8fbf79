"""What the claimer does with a batch between the claim and the first request.

The claimer runs in-process against a real PostgreSQL database; the HTTP request is a
function that notes when it started, so the test sees exactly what was started and what was
handed back. Triggers make the database slow or refuse, as a real one may.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import select, text

import outbox
from outbox.db import make_async_engine
from outbox.schema import breakers, messages
from supervisor.cycle.attempt import Outcome
from supervisor.cycle.claimer import Claimer
from supervisor.observe.metrics import Metrics
from supervisor.cycle.outage import OutageGuard

from tests.ledger import enqueue_batch, message_key

URL = "https://buyer.example.com/hook"


class Recorder:
    """The claimer's two exits: a request started (and answered at once), or an outcome."""

    def __init__(self) -> None:
        self.started: dict[int, float] = {}  # message id -> host time the request started
        self.outcomes: list[Outcome] = []

    async def attempt(self, message):
        self.started[message.id] = time.time()
        return Outcome(message, "delivered", "success", http_status=200, sent=True)

    def released(self) -> set[int]:
        return {o.message.id for o in self.outcomes if o.action == "release"}


async def _run(pg_url: str, recorder: Recorder, until, *, metrics: Metrics | None = None,
               outage: OutageGuard | None = None, **env: str) -> float:
    """Run a claimer until ``until()`` (and 0.3 s more); how long it took to stop when told."""
    settings = outbox.load_settings(env={"OUTBOX_DATABASE_URL": pg_url, **env})
    engine = make_async_engine(pg_url)
    claimer = Claimer(engine, settings=settings, daemon_id="unit", metrics=metrics or Metrics(),
                      attempt=recorder.attempt, submit=recorder.outcomes.append, outage=outage or OutageGuard(60))
    task = asyncio.create_task(claimer.run())
    try:
        deadline = time.monotonic() + 30
        while not until() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # anything more it would do, it does now
    finally:
        claimer.stop()
        told = time.monotonic()
        await asyncio.wait_for(task, 10)
        await claimer.aclose()
        await engine.dispose()
    return time.monotonic() - told


@contextmanager
def _trigger(engine, table: str, when: str, body: str) -> Iterator[None]:
    """A row trigger on ``table`` running ``body`` (PL/pgSQL) before each update ``when``, for
    the duration of the block."""
    with engine.begin() as conn:
        conn.execute(text(f"CREATE FUNCTION outbox_test_fn() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN {body}"
                          " RETURN NEW; END $$"))
        conn.execute(text(f"CREATE TRIGGER outbox_test BEFORE UPDATE ON {table} FOR EACH ROW WHEN ({when})"
                          " EXECUTE FUNCTION outbox_test_fn()"))
    try:
        yield
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP TRIGGER outbox_test ON {table}"))
            conn.execute(text("DROP FUNCTION outbox_test_fn()"))


@pytest.fixture
def slow_leases(pg_engine) -> Iterator[None]:
    """Each leased row costs the claim statement 0.6 s after it read the clock (a slow disk,
    a busy server): its leases are that much older than the answer."""
    with _trigger(pg_engine, "outbox_messages", "NEW.state = 'in_flight'", "PERFORM pg_sleep(0.6);"):
        yield


async def test_a_lease_is_never_older_than_its_stamp_says(pg_engine, pg_url, slow_leases) -> None:
    """Lease 5 s, attempts of up to 4 s (2 + 2): a message may start only within 0.5 s of its
    lease's start. The claim of two rows returns 1.2 s after it leased them: neither may
    start (its attempt could outlive its lease); both go back unsent."""
    enqueue_batch(pg_engine, [("t", URL, message_key("aged", i)) for i in range(2)])
    recorder = Recorder()
    await _run(pg_url, recorder, lambda: len(recorder.started) + len(recorder.released()) >= 2,
               OUTBOX_LEASE_SECONDS="5", OUTBOX_CONNECT_TIMEOUT_SECONDS="2", OUTBOX_READ_TIMEOUT_SECONDS="2")
    with pg_engine.connect() as conn:
        lease_ends = dict(conn.execute(select(messages.c.id, messages.c.lease_expires_at)).all())
    for message_id, started in recorder.started.items():  # PostgreSQL runs on this host: one clock
        assert started + 4.0 < lease_ends[message_id], "an attempt that may outlive its lease was started"
    assert recorder.released() == set(lease_ends), "both leases were too old to start an attempt"


@pytest.fixture
def refused_probes(pg_engine) -> Iterator[None]:
    """The database refuses to hand out a half-open probe."""
    with _trigger(pg_engine, "outbox_breakers", "NEW.state = 'half_open'", "RAISE EXCEPTION 'probe refused';"):
        yield


@pytest.mark.parametrize("probe_first", [True, False])
async def test_a_failed_probe_leaves_nothing_of_its_batch_leased_unstarted(pg_engine, pg_url, refused_probes,
                                                                           probe_first: bool) -> None:
    """One batch: the probe of a tripped endpoint (its open period over) and four messages of
    healthy tenants. The probe fails in the database: the four start, the probe's message
    goes back unsent, and no row stays leased without a request or a hand-back."""
    now = time.time()
    with pg_engine.begin() as conn:
        conn.execute(breakers.insert().values(tenant_id="bad", origin="https://buyer.example.com", state="open",
                                              failures=5, trips=1, open_until=now - 1, updated_at=now - 60))
    healthy = [(f"good{i}", URL, message_key("healthy", i)) for i in range(4)]
    batches = [[("bad", URL, message_key("probe", 0))], healthy]
    for batch in (batches if probe_first else batches[::-1]):
        enqueue_batch(pg_engine, batch)
    recorder = Recorder()
    await _run(pg_url, recorder, lambda: len(recorder.started) + len(recorder.released()) >= 5)
    with pg_engine.connect() as conn:
        rows = {r.tenant_id: r for r in conn.execute(select(messages.c.id, messages.c.tenant_id, messages.c.state))}
    leased = {r.id for r in rows.values() if r.state == "in_flight"}
    assert set(recorder.started) == {rows[f"good{i}"].id for i in range(4)}
    assert rows["bad"].id in recorder.released() and rows["bad"].id not in recorder.started
    assert leased <= set(recorder.started) | recorder.released(), "a leased row was neither started nor handed back"


async def test_rows_another_claim_holds_are_taken_soon_after_it_lets_go_without_spinning(pg_engine, pg_url) -> None:
    """Another daemon's claim holds the only due rows for 0.8 s, so every claim of this one
    comes back contended and empty. It claims again at once, then backs off (doubling): it
    takes the rows long before its poll (30 s here, to tell the two apart) and makes a few
    claims, not hundreds, while they are held."""
    enqueue_batch(pg_engine, [(f"t{i}", URL, message_key("held", i)) for i in range(5)])
    hold_seconds = 0.8

    def hold() -> float:
        with pg_engine.begin() as conn:
            conn.execute(text("SELECT id FROM outbox_messages FOR UPDATE"))
            time.sleep(hold_seconds)
            return time.time()

    recorder, metrics = Recorder(), Metrics()
    holder = asyncio.get_running_loop().run_in_executor(None, hold)
    await asyncio.sleep(0.1)  # the rows are held before the first claim
    await _run(pg_url, recorder, lambda: len(recorder.started) >= 5, metrics=metrics,
               OUTBOX_POLL_INTERVAL_SECONDS="30")
    released = await holder
    assert len(recorder.started) == 5
    # The pause doubles from 10 ms: at most ~0.64 s when the rows are let go, far from the poll.
    assert max(recorder.started.values()) - released < 2.0, "the claimer waited for its poll"
    claims = metrics.registry.get_sample_value("outbox_claim_batch_size_count")
    assert claims <= 20, f"{claims:.0f} claims in {hold_seconds} s: the claimer spun on locked rows"


class Paced(Recorder):
    """Requests of 4 to 14 ms, varying by message, so that they end one by one, some while
    a claim is out."""

    async def attempt(self, message):
        await asyncio.sleep(0.004 + 0.001 * (message.id * 7 % 11))
        return await super().attempt(message)


async def test_requests_ending_while_a_claim_refills_their_origin_do_not_earn_a_claim_of_their_own(
        pg_engine, pg_url) -> None:
    """A backlog on one origin, drained with the defaults (8 requests at a time, 16 leases):
    the claimer refills the origin's queue when half a round or less waits, so each claim
    takes at least the 4 slots that frees. Requests end one by one, some while a claim is
    out; each asks for a refill, which that very claim provides. No claim in the middle of
    the drain may take only the one or two slots freed meanwhile: that is a claim's whole
    cost for a sliver of its work. Only the drain's last claim may take the one or two left."""
    count = 200
    enqueue_batch(pg_engine, [(f"t{i % 4}", URL, message_key("paced", i)) for i in range(count)])
    recorder, metrics = Paced(), Metrics()
    # A poll mid-drain (the machine slow) may claim a sliver on its own account: not under test.
    await _run(pg_url, recorder, lambda: len(recorder.started) >= count, metrics=metrics,
               OUTBOX_POLL_INTERVAL_SECONDS="30")
    assert len(recorder.started) == count

    def claims(at_most: int) -> float:
        return metrics.registry.get_sample_value("outbox_claim_batch_size_bucket", {"le": f"{at_most:.1f}"})

    slivers = claims(2) - claims(0)
    total = metrics.registry.get_sample_value("outbox_claim_batch_size_count")
    assert slivers <= 1, f"{slivers:.0f} of {total:.0f} claims took one or two rows of a backlog"


@pytest.fixture
def misconfigured_claims(pg_engine) -> Iterator[None]:
    """Every lease fails the way a prepared statement out of place does behind a pooler
    (SQLSTATE 26000): a failure retrying cannot cure, so the outage guard waits out its bound."""
    with _trigger(pg_engine, "outbox_messages", "NEW.state = 'in_flight'",
                  "RAISE EXCEPTION 'prepared statement \"_pg3_0\" does not exist' USING ERRCODE = '26000';"):
        yield


async def test_a_claimer_waiting_out_an_incurable_failure_stops_when_told(pg_engine, pg_url,
                                                                         misconfigured_claims) -> None:
    """The guard's bound is 60 s (the default): told to stop (SIGTERM), the claimer ends now,
    not when the bound would have ended the daemon anyway."""
    enqueue_batch(pg_engine, [("t", URL, message_key("incurable", 0))])
    guard = OutageGuard(60)
    took = await _run(pg_url, Recorder(), lambda: guard.problem() is not None, outage=guard)
    assert "OUTBOX_DATABASE_POOLER=transaction" in (guard.problem() or ""), guard.problem()
    assert took < 1.0, f"stopped {took:.1f} s after it was told"
