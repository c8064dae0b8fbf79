"""The delivery ledger of end-to-end tests: enqueue messages under known keys, read back
what became of them, and check the invariants a run ends with (every arrival the stored
bytes and verified, nothing delivered twice or without a 200, every attempt recorded once).
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

import outbox
from outbox.schema import attempts, messages
from tests import procs

# A throwaway body-encryption key (32 bytes, base64), for tests that seal at rest.
THROWAWAY_KEY = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8="


def loopback_producer(**env: str) -> outbox.Settings:
    """A seller's settings that may enqueue to the tests' loopback receivers over plain HTTP,
    with ``env``'s other ``OUTBOX_*`` variables (``OUTBOX_ENCRYPTION_KEY=...``)."""
    return outbox.load_settings(env={"OUTBOX_ALLOW_HTTP": "true", "OUTBOX_ALLOWED_CIDRS": "127.0.0.0/8", **env})


PRODUCER = loopback_producer()


def message_key(run: str, n: int) -> str:
    """The ``n``th idempotency key of a run: known in advance, so a retried enqueue replays it."""
    return f"whk_test_{run}_{n:08d}"


def enqueue_batch(engine: Any, items: Iterable[tuple[str, str, str]], *, retry_for: float = 60.0) -> None:
    """Enqueue ``(tenant, url, key)`` items in one seller transaction, retried while the database is away.

    The caller chooses the keys, so a retry after an ambiguous commit is an idempotent
    replay of the same bytes (the same key and payload return the stored message).
    """
    items = list(items)
    deadline = time.monotonic() + retry_for
    while True:
        try:
            with engine.begin() as conn:
                for tenant, url, key in items:
                    outbox.enqueue(conn, tenant_id=tenant, url=url, idempotency_key=key, settings=PRODUCER,
                                   payload={"kind": "test", "tenant": tenant, "key_again": key, "pad": "x" * 64})
            return
        except OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def load_messages(engine: Any) -> dict[str, Any]:
    """Every stored message, by idempotency key."""
    with engine.connect() as conn:
        return {r.idempotency_key: r for r in conn.execute(select(
            messages.c.id, messages.c.idempotency_key, messages.c.tenant_id, messages.c.url, messages.c.state,
            messages.c.dead_reason, messages.c.attempts, messages.c.body_sha256, messages.c.lease_expires_at))}


def load_attempts(engine: Any) -> dict[int, list[Any]]:
    """Every attempt row, by message id, in the order they were written."""
    out: dict[int, list[Any]] = collections.defaultdict(list)
    with engine.connect() as conn:
        for r in conn.execute(select(attempts.c.message_id, attempts.c.attempt_number, attempts.c.outcome,
                                     attempts.c.idempotency_key, attempts.c.daemon_id, attempts.c.occurred_at,
                                     attempts.c.error).order_by(attempts.c.id)):
            out[r.message_id].append(r)
    return out


def arrivals_by_key(*logs: Path) -> dict[str, list[dict[str, Any]]]:
    """Every request the receivers logged, by idempotency key."""
    by_key: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for log in logs:
        for arrival in procs.arrivals(log):
            by_key[arrival["key"]].append(arrival)
    return by_key


def daemon_events(log: Path) -> list[dict[str, Any]]:
    """The daemon's JSON log events (other lines skipped)."""
    events = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def check_ledger(engine: Any, logs: Iterable[Path], *, never_delivered: Iterable[str] = ()) -> dict[str, Any]:
    """The invariants every fault test ends with; returns a small summary for the caller.

    * every arrival is of a stored message, verified, with exactly the stored bytes;
    * a message is ``delivered`` only if the receiver logged a 200 for its key, and it has
      exactly one ``success`` attempt row (never lost, never recorded twice);
    * its attempt rows are exactly 1..attempts, one row per number
      (an attempt cut short by a crash has its ``abandoned`` row);
    * there are at least as many attempt rows as arrivals (every request is in the log).
    """
    stored = load_messages(engine)
    by_id = {m.id: m for m in stored.values()}
    rows = load_attempts(engine)
    by_key = arrivals_by_key(*logs)
    never = set(never_delivered)
    summary = collections.Counter()
    for key, arrived in by_key.items():
        assert key in stored, f"the receiver got a key that was never enqueued: {key!r}"
        sha = bytes(stored[key].body_sha256).hex()
        for a in arrived:
            assert a["sha256"] == sha, f"{key}: an arrival carried different bytes"
            assert a["verified"], f"{key}: an arrival failed signature verification: {a['problem']}"
    for key, m in stored.items():
        arrived = by_key.get(key, [])
        real = rows.get(m.id, [])
        numbers = sorted(r.attempt_number for r in real)
        assert numbers == list(range(1, m.attempts + 1)), \
            f"{key}: attempt rows {[(r.attempt_number, r.outcome) for r in rows.get(m.id, [])]} " \
            f"do not cover 1..{m.attempts} exactly once ({m.state}, {len(arrived)} arrivals)"
        assert all(r.idempotency_key == key for r in rows.get(m.id, []))
        successes = sum(r.outcome == "success" for r in real)
        assert len(real) >= len(arrived), f"{key}: {len(arrived)} arrivals but only {len(real)} attempt rows"
        if m.state == "delivered":
            assert any(a["status"] == 200 for a in arrived), f"{key}: delivered without a 200 at the receiver"
            assert successes == 1, f"{key}: delivered with {successes} success rows"
            assert key not in never, f"{key}: delivered from an endpoint that never accepts"
        else:
            assert successes == 0, f"{key}: {m.state} but has a success row"
        summary[m.state] += 1
        summary["arrivals"] += len(arrived)
        summary["resent"] += max(len(arrived) - 1, 0)
        summary["abandoned"] += sum(r.outcome == "abandoned" for r in real)
    for message_id in rows:
        assert message_id in by_id, f"attempt rows for unknown message {message_id}"
    return dict(summary)


def task_webhook(conn: Any, task_id: str, url: str, *, tenant: str = "acme", settings: outbox.Settings = PRODUCER,
                 token: str | None = "e2e-token-0123456789") -> outbox.EnqueuedMessage:
    """Enqueue, in the caller's transaction, the one webhook shape delivery tests send: a
    completed ``create_media_buy`` task ``task_id`` (result ``mb_<task_id>``) to ``url``."""
    config = {"url": url, "operation_id": f"op_{task_id}", **({"token": token} if token else {})}
    return outbox.enqueue_task_webhook(conn, tenant_id=tenant, task_id=task_id, task_type="create_media_buy",
                                       status="completed", result={"media_buy_id": f"mb_{task_id}"},
                                       settings=settings, push_notification_config=config)


def enqueue_many(engine: Any, base: str, paths: list[str], *, tenants: int = 1, per_txn: int = 200) -> list[str]:
    """Enqueue one :func:`task_webhook` per path under ``base``, ``per_txn`` per seller
    transaction, across ``tenants`` tenants in turn; their idempotency keys."""
    keys = []
    for start in range(0, len(paths), per_txn):
        with engine.begin() as conn:
            keys += [task_webhook(conn, f"task_{i}", f"{base}{path}", tenant=f"tenant-{i % tenants}").idempotency_key
                     for i, path in enumerate(paths[start:start + per_txn], start)]
    return keys


def enqueue_tasks(engine: Any, tenant: str, url: str, n: int, start: int = 0) -> list[int]:
    """Enqueue ``n`` :func:`task_webhook` for ``tenant`` to ``url`` in one seller transaction
    (task ids ``<tenant><start>`` on); their message ids."""
    with engine.begin() as conn:
        return [task_webhook(conn, f"{tenant}{i}", url, tenant=tenant).id for i in range(start, start + n)]


def states(engine: Any) -> collections.Counter[str]:
    """Messages per state."""
    with engine.connect() as conn:
        return collections.Counter(dict(conn.execute(select(messages.c.state, func.count())
                                                     .group_by(messages.c.state)).all()))


def finished(engine: Any, total: int, *, final: Iterable[str] = ("delivered", "dead"),
             database_may_be_away: bool = False) -> bool:
    """Whether ``total`` messages are in the ``final`` states.

    A test that restarts the database on purpose passes ``database_may_be_away`` and reads
    ``False`` while it is down; every other test sees the connection error itself, at once,
    instead of a wait that times out.
    """
    try:
        counts = states(engine)
    except OperationalError:
        if database_may_be_away:
            return False
        raise
    return sum(counts[s] for s in final) == total


def leased_by(engine: Any, pid: int) -> int:
    """Rows leased by the daemon process ``pid`` (daemon ids are ``host:pid:random``)."""
    with engine.connect() as conn:
        return conn.execute(select(func.count()).where(messages.c.leased_by.like(f"%:{pid}:%"))).scalar_one()


def exit_line(log: Path) -> str:
    """The daemon's last ``outboxd run:`` line on stderr (why it exited), or ``""``."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("outboxd run:")]
    return lines[-1] if lines else ""
