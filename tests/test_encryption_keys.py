"""The agreed encryption key (outbox/keyset.py) on a real database: when a new key may seal,
what holds it back, and what the producer's hot path pays for it."""

from __future__ import annotations

import base64
import os

from sqlalchemy import event, update

import outbox
from outbox.keyset import adopt, forget, read_ledger, report, sealer
from outbox.schema import attempts, encryption_readers
from outbox.sealing import sealing_keys


def key() -> bytes:
    return os.urandom(32)


def settle(engine, reader_id: str, keys, role: str = "daemon"):
    """One report and, for a daemon, one attempt to agree: (the agreed key id, the ledger)."""
    with engine.begin() as conn:
        ledger = report(conn, reader_id=reader_id, role=role, keys=keys)
        adopted = adopt(conn, ledger) if role == "daemon" else None
    return adopted or ledger.sealing_key_id, ledger


def test_a_new_key_seals_only_once_every_live_process_opens_it(engine):
    old, new = key(), key()
    before, during = sealing_keys(old), sealing_keys(new, (old,))
    assert settle(engine, "d1", before)[0] == before.active_id  # the first key is agreed at once
    agreed, _ = settle(engine, "p1", during, role="producer")  # rolled first: announces the new key
    assert agreed == before.active_id
    assert sealer(during, agreed).active_id == before.active_id  # and keeps sealing under the old one
    agreed, ledger = settle(engine, "d2", during)  # a rolled daemon cannot agree while d1 lacks the key
    assert agreed == before.active_id and ledger.lacking(during.active_id) == ["d1"]
    assert settle(engine, "d1", during)[0] == during.active_id  # the last process rolled: it seals
    assert sealer(during, during.active_id).active_id == during.active_id
    assert sealer(before, during.active_id).active_id == before.active_id  # a stale process seals its own


def test_a_stopped_process_stops_counting_at_once(engine):
    old, new = key(), key()
    settle(engine, "d1", sealing_keys(old))
    settle(engine, "d2", sealing_keys(new, (old,)))
    with engine.begin() as conn:
        assert read_ledger(conn).lacking(sealing_keys(new).active_id) == ["d1"]
        forget(conn, "d1")
        assert read_ledger(conn).lacking(sealing_keys(new).active_id) == []
    assert settle(engine, "d2", sealing_keys(new, (old,)))[0] == sealing_keys(new).active_id


def test_a_daemon_that_never_reported_holds_a_rotation_back(engine):
    """A previous release's daemon does not report: its recent attempts block the new key."""
    old, new = key(), key()
    settle(engine, "d1", sealing_keys(old))
    with engine.begin() as conn:
        conn.execute(attempts.insert().values(message_id=1, tenant_id="t", url="https://b.example/", attempt_number=1,
                                              outcome="success", will_retry=False, idempotency_key="k",
                                              trigger="scheduled", daemon_id="previous-release"))
    rotated = sealing_keys(new, (old,))
    assert settle(engine, "d1", rotated)[0] == sealing_keys(old).active_id
    with engine.begin() as conn:  # fifteen seconds later, nothing of it is recent any more
        conn.execute(update(attempts).values(occurred_at=attempts.c.occurred_at - 60))
    assert settle(engine, "d1", rotated)[0] == rotated.active_id


def test_an_enqueue_pays_no_round_trip_for_the_agreement(engine):
    settings = outbox.load_settings(env={"OUTBOX_ENCRYPTION_KEY": base64.b64encode(key()).decode()})
    statements: list[str] = []

    def enqueue(n: int) -> None:
        with engine.begin() as conn:
            outbox.enqueue(conn, tenant_id="t", url="https://buyer.example/hook", settings=settings,
                           payload={"n": n})

    enqueue(0)  # the first enqueue of a process reads and reports the agreement
    with engine.connect() as conn:
        [reader] = conn.execute(encryption_readers.select()).all()
    assert reader.role == "producer" and reader.sealing_key_id == settings.sealing().active_id
    event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    for n in range(1, 21):
        enqueue(n)
    assert not [s for s in statements if "outbox_encryption" in s]
    assert len([s for s in statements if s.lstrip().upper().startswith("INSERT")]) == 20
