"""A known history for the console's tests: messages to three endpoints of two tenants, their
attempts spread over two days, an open breaker and a keyring, all written to a real database.
The endpoint-health rollup the charts read is added from the same attempts as the completer
adds it (``health_stats.Recorded.of``, ``tally`` and the real upsert), minute by minute.

What the console must show is then computed back from these rows in plain Python (never by
the console's own queries).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, insert, select, update
from sqlalchemy.engine import Engine

import outbox
from outbox.config import load_settings
from outbox.schema import attempts, breakers, db_now, messages
from supervisor.keys import keyring
from supervisor.observe import health_stats
from supervisor.wire.signing import generate_signing_key_pem, load_signing_key

from tests.ledger import PRODUCER

ENDPOINTS = (("acme", "http://127.0.0.1:9001"), ("acme", "http://127.0.0.1:9002"), ("globex", "http://127.0.0.1:9003"))
OPEN_ENDPOINT = ENDPOINTS[2]
DAEMONS = ("outboxd-7f9c-a", "outboxd-7f9c-b")
DUE_AGO = 42.0  # the pending messages have waited this long past their due time when seeded
# No attempt falls in (now - QUIET_FROM, now - QUIET_TO): the five-minute rates then read the
# same rows whether the page is drawn at once or up to a minute and a half later.
QUIET_FROM, QUIET_TO = 400.0, 200.0
FAILURES = ((503, "failed", "HTTP 503"), (500, "failed", "HTTP 500"), (None, "timeout", "read timed out"),
            (None, "connection_error", "connection refused"))


@dataclass(frozen=True)
class Seeded:
    now: float  # the database's time when seeding ended
    featured: int  # a message that failed three times, then was delivered
    pending: int


def _attempt_times(rng: random.Random, now: float, count: int) -> list[float]:
    """Attempt times of one message: mostly within the hour, some within the day, a few older."""
    first = now - rng.choice((rng.uniform(0, 3500), rng.uniform(0, 3500), rng.uniform(3600, 86000),
                              rng.uniform(86400, 150000)))
    times = [first + i * rng.uniform(5, 90) for i in range(count)]
    return [t for t in times if not now - QUIET_FROM < t < now - QUIET_TO and t < now - 1]


def seed(engine: Engine, directory: Path, *, per_endpoint: int = 40, rng_seed: int = 7) -> Seeded:
    rng = random.Random(rng_seed)
    with engine.begin() as conn:
        now = float(conn.execute(select(db_now())).scalar_one())
        rows, pending = [], 0
        for e, (tenant, origin) in enumerate(ENDPOINTS):
            for n in range(per_endpoint):
                key = outbox.enqueue_task_webhook(
                    conn, tenant_id=tenant, task_id=f"task_{e}_{n}", task_type="create_media_buy",
                    status="completed", result={"media_buy_id": f"mb_{e}_{n}"}, settings=PRODUCER,
                    push_notification_config={"url": f"{origin}/hooks/{n}", "token": "console-test-token-0123456789",
                                              "operation_id": f"op_{e}_{n}"}).idempotency_key
                message_id = conn.execute(select(messages.c.id).where(messages.c.idempotency_key == key)).scalar_one()
                failing = rng.random() < (0.6 if (tenant, origin) == OPEN_ENDPOINT else 0.15)
                times = _attempt_times(rng, now, rng.randint(2, 4) if failing else 1)
                for number, at in enumerate(times, 1):
                    last = number == len(times)
                    status, outcome, error = rng.choice(FAILURES) if failing and not last else (200, "success", None)
                    if failing and last and rng.random() < 0.4:
                        status, outcome, error = 410, "failed", "HTTP 410"
                    rows.append({"message_id": message_id, "tenant_id": tenant, "url": f"{origin}/hooks/{n}",
                                 "attempt_number": number, "outcome": outcome, "http_status": status, "error": error,
                                 "response_time_ms": None if outcome == "connection_error" else rng.randint(8, 900),
                                 "will_retry": not last, "idempotency_key": key, "trigger": "scheduled",
                                 "daemon_id": DAEMONS[(e + number) % len(DAEMONS)],
                                 "occurred_at": at, "origin": origin,
                                 "died": last and n % 9 != 0 and outcome != "success"})
                if not times or n % 9 == 0:  # never attempted, or due again: the backlog
                    pending += 1
                    conn.execute(update(messages).where(messages.c.id == message_id).values(
                        next_attempt_at=now - DUE_AGO - n, attempts=len(times), created_at=now - DUE_AGO - n - 5))
                    continue
                final = rows[-1]
                dead = final["outcome"] != "success"
                conn.execute(update(messages).where(messages.c.id == message_id).values(
                    state="dead" if dead else "delivered", dead_reason="gone" if dead else None,
                    attempts=len(times), first_attempt_at=times[0], finished_at=times[-1], created_at=times[0] - 2,
                    last_status=final["http_status"], last_error=final["error"]))
        conn.execute(insert(attempts), [{k: v for k, v in r.items() if k not in ("origin", "died")} for r in rows])
        _rollup(conn, rows)
        featured = _featured(conn, now)
        conn.execute(insert(breakers).values(tenant_id=OPEN_ENDPOINT[0], origin=OPEN_ENDPOINT[1], state="open",
                                             failures=7, trips=2, open_until=now + 95, window_attempts=12,
                                             window_failures=9, updated_at=now - 25))
        _keyring(conn, directory)
        now = float(conn.execute(select(db_now())).scalar_one())
    return Seeded(now=now, featured=featured, pending=pending)


def _featured(conn, now: float) -> int:
    """A message that met a 503, another 503 and a timeout, then was delivered."""
    key = outbox.enqueue_task_webhook(
        conn, tenant_id="acme", task_id="task_featured", task_type="create_media_buy", status="completed",
        result={"media_buy_id": "mb_featured"}, settings=PRODUCER,
        push_notification_config={"url": f"{ENDPOINTS[0][1]}/hooks/featured?sig=query-secret",
                                  "token": "console-test-token-0123456789", "operation_id": "op_featured"},
    ).idempotency_key
    message_id = conn.execute(select(messages.c.id).where(messages.c.idempotency_key == key)).scalar_one()
    trail = ((503, "failed", "HTTP 503", 180), (503, "failed", "HTTP 503", 150),
             (None, "timeout", "read timed out", 10000),
             (200, "success", None, 95))
    rows = [{"message_id": message_id, "tenant_id": "acme", "url": f"{ENDPOINTS[0][1]}/hooks/featured",
             "attempt_number": number, "outcome": outcome, "http_status": status, "error": error,
             "response_time_ms": ms, "will_retry": number < 4, "idempotency_key": key, "trigger": "scheduled",
             "daemon_id": DAEMONS[0], "occurred_at": now - 3000 + 600 * number}
            for number, (status, outcome, error, ms) in enumerate(trail, 1)]
    conn.execute(insert(attempts), rows)
    _rollup(conn, [r | {"origin": ENDPOINTS[0][1], "died": False} for r in rows])
    conn.execute(update(messages).where(messages.c.id == message_id).values(
        state="delivered", attempts=4, created_at=now - 2405, first_attempt_at=now - 2400, next_attempt_at=now - 600,
        retry_until=now - 2405 + 86400,
        finished_at=now - 600, last_status=200))
    return int(message_id)


def _rollup(conn, rows: list[dict]) -> None:
    """What the completer would have added to the rollup for these attempt rows, each in its
    own minute and daemon's row."""
    flushes: dict[tuple[int, str], list[health_stats.Recorded]] = defaultdict(list)
    for r in rows:
        flushes[(int(r["occurred_at"] // 60), r["daemon_id"])].append(health_stats.Recorded.of(
            r["tenant_id"], r["origin"], r["outcome"], r["response_time_ms"], r["died"]))
    for (minute, daemon), recorded in flushes.items():
        tallied = health_stats.tally(recorded, now=minute * 60.0, daemon_id=daemon)
        conn.execute(health_stats.upsert(conn.dialect.name), {"rows": json.dumps(tallied)})


def _keyring(conn, directory: Path) -> None:
    """One active signing key for everyone and one staged next to it."""
    for kid in ("console-active", "console-next"):
        (directory / f"{kid}.pem").write_bytes(generate_signing_key_pem("ed25519"))
    settings = load_settings(env={"OUTBOX_SIGNING_KEY_FILE": str(directory / "console-active.pem"),
                                  "OUTBOX_SIGNING_KEY_ID": "console-active"})
    keyring.bootstrap(conn, settings)
    path = directory / "console-next.pem"
    keyring.stage(conn, scope="", key=load_signing_key(path, "console-next"), key_file=str(path))


def pending_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(messages)
                                .where(messages.c.state.in_(("pending", "in_flight")))).scalar_one())


@dataclass(frozen=True)
class Tally:
    """What one chart bucket must show, counted from the attempt rows."""

    delivered: int
    failed: int
    latency_avg_ms: float | None
    latency_max_ms: int | None
    daemons: int


def attempt_rows(engine: Engine) -> list:
    with engine.connect() as conn:
        return list(conn.execute(select(attempts.c.tenant_id, attempts.c.url, attempts.c.outcome,
                                        attempts.c.occurred_at, attempts.c.response_time_ms, attempts.c.daemon_id)))


def tally(rows: list, start: float, end: float, tenant: str | None = None, origin: str | None = None) -> Tally:
    """Attempts in ``[start, end)`` of everyone, a tenant or an endpoint, counted in Python."""
    chosen = [r for r in rows if start <= r.occurred_at < end and (tenant is None or r.tenant_id == tenant)
              and (origin is None or r.url.startswith(origin + "/"))]
    delivered = sum(r.outcome == "success" for r in chosen)
    failed = sum(r.outcome in ("failed", "timeout", "connection_error") for r in chosen)
    times = [r.response_time_ms for r in chosen if r.response_time_ms is not None
             and r.outcome in ("success", "failed", "timeout", "connection_error")]
    return Tally(delivered, failed, sum(times) / len(times) if times else None, max(times, default=None),
                 len({r.daemon_id for r in chosen if r.daemon_id is not None}))
