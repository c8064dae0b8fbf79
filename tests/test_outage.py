"""supervisor.cycle.outage: failed statements are counted per activity, and their cause is named
from the database's own errors (real PostgreSQL, no stand-ins)."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from supervisor.cycle.outage import POOLER_HINT, DatabaseUnavailable, OutageGuard, diagnose


def _error_of(pg_url: str, *statements: str) -> psycopg.Error:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        try:
            for statement in statements:
                conn.execute(statement)
        except psycopg.Error as exc:
            return exc
    raise AssertionError("the statements did not fail")


@pytest.mark.parametrize("statements", [
    ("PREPARE _pg3_0 AS SELECT 1", "PREPARE _pg3_0 AS SELECT 2"),  # already exists
    ("EXECUTE _pg3_9",),  # does not exist
])
def test_a_prepared_statement_out_of_place_is_named_and_incurable(pg_url, statements):
    cause = diagnose(_error_of(pg_url, *statements))
    assert cause.label == "prepared_statements" and cause.text == POOLER_HINT and not cause.curable


def test_other_failures_are_curable(pg_url):
    assert diagnose(_error_of(pg_url, "SELECT * FROM no_such_table")).label == "statement"
    assert diagnose(_error_of(pg_url, "SET statement_timeout = 1", "SELECT pg_sleep(1)")).label == "timeout"
    assert diagnose(TimeoutError()).label == "timeout"
    with pytest.raises(psycopg.OperationalError) as refused:
        psycopg.connect("postgresql://postgres@127.0.0.1:1/postgres", connect_timeout=2)
    assert diagnose(refused.value).curable and diagnose(refused.value).label == "connection"


async def test_claims_that_keep_failing_trip_the_guard_while_other_statements_succeed():
    guard = OutageGuard(0.5)
    with pytest.raises(DatabaseUnavailable, match="claim messages"):
        for _ in range(50):
            guard.ok("maintenance")  # another activity's success does not end the claims' outage
            assert guard.problem() is None or "claim messages" in guard.problem()
            await guard.failed("claim messages", ConnectionError("refused"))
    guard.ok("claim messages")
    assert guard.problem() is None and guard.recovered.is_set()


async def test_an_incurable_failure_stays_on_readyz_and_ends_the_daemon_after_the_deadline(pg_url):
    errors: list[str] = []
    guard = OutageGuard(0.3, on_error=errors.append)
    error = _error_of(pg_url, "EXECUTE _pg3_9")
    waiting = asyncio.create_task(guard.failed("record outcomes", error))
    await asyncio.sleep(0.05)
    guard.ok("record outcomes")  # a later success does not make it safe again
    assert POOLER_HINT in (guard.problem() or "")
    with pytest.raises(DatabaseUnavailable, match="OUTBOX_DATABASE_POOLER=transaction"):
        await waiting
    assert errors == ["prepared_statements"]
