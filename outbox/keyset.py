"""Which encryption key seals: agreed through the database by every process that opens.

Keys stay in each process's configuration (``OUTBOX_ENCRYPTION_KEY``, older ones in
``OUTBOX_ENCRYPTION_OLD_KEYS``); the database holds only their public ids. Every process
announces its ``OUTBOX_ENCRYPTION_KEY`` in ``outbox_encryption_keys`` and reports, in
``outbox_encryption_readers``, the ids it can open. A daemon makes the newest announced key
the sealing key (``seals_from``) only once every live process reports that it opens it and
no recent lease or attempt belongs to a process that does not report (a previous release).
From then on every process that has the key seals under it, and the re-sealers move older
rows onto it. So a process rolled onto a new key first keeps sealing under the old one
until the last process can open the new one: whatever the order of a rolling rotation, no
process meets a row it cannot open (docs/encryption.md).

Producers read the agreement through the caller's connection at most every
``REFRESH_SECONDS`` and cache it, so an enqueue costs no extra round trip.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any
from weakref import WeakKeyDictionary

from sqlalchemy import Connection, Engine, delete, inspect, select, update
from sqlalchemy.dialects import postgresql, sqlite

from outbox.config import Settings
from outbox.schema import attempts, db_now, encryption_keys, encryption_readers, messages
from outbox.sealing import SealingKeys, key_id

REFRESH_SECONDS = 5.0  # a producer's cached agreement, and a daemon's report, are this old at most
LIVE_SECONDS = 15.0  # a process that has not reported for this long no longer counts
FORGET_SECONDS = 86_400.0  # a reader row this old is dropped
_AGED = db_now() - LIVE_SECONDS - 1  # the seen_at of a process that stopped: no longer live, still known


@dataclass(frozen=True)
class Reader:
    reader_id: str
    role: str
    key_ids: frozenset[str]
    sealing_key_id: str | None
    unopenable: int
    seen_at: float


@dataclass(frozen=True)
class Ledger:
    """The keys announced and the live readers, as read at ``now`` (database time)."""

    now: float
    announced: dict[str, tuple[float, float | None]]  # key id -> (announced_at, seals_from)
    readers: tuple[Reader, ...]

    @property
    def sealing_key_id(self) -> str | None:
        """The agreed key: the one that started sealing last (``None`` before any agreement)."""
        sealing = [(since, kid) for kid, (_, since) in self.announced.items() if since is not None]
        return max(sealing)[1] if sealing else None

    def live(self) -> tuple[Reader, ...]:
        return tuple(r for r in self.readers if r.seen_at > self.now - LIVE_SECONDS)

    def candidate(self) -> str | None:
        """The newest announced key newer than the agreed one: the rotation under way."""
        current = self.sealing_key_id
        after = -1.0 if current is None else self.announced[current][0]
        newer = [(at, kid) for kid, (at, since) in self.announced.items() if since is None and at > after]
        return max(newer)[1] if newer else None

    def lacking(self, kid: str) -> list[str]:
        """The live processes that cannot open ``kid``."""
        return [r.reader_id for r in self.live() if kid not in r.key_ids]


def sealer(keys: SealingKeys | None, agreed: str | None) -> SealingKeys | None:
    """The keys a process seals with: under the agreed key when it has it.

    Before any agreement (the first start of this release), a process configured with
    ``OUTBOX_ENCRYPTION_OLD_KEYS`` is mid-rotation: it seals under the first of them, the
    key the previous configuration sealed under, which processes not yet rolled (and a
    previous release) open. A process that lacks the agreed key (started with a stale
    configuration) seals under its own ``OUTBOX_ENCRYPTION_KEY``.
    """
    if keys is None:
        return None
    if agreed is None:
        return keys.sealing_under(key_id(keys.older[0])) if keys.older else keys
    return keys.sealing_under(agreed) if keys.can_open(agreed) else keys


def process_id(role: str) -> str:
    """This process's reader id (a producer's threads report separately: no shared row lock)."""
    return f"{_process_prefix(role)}{threading.get_ident()}"


def _process_prefix(role: str) -> str:
    return f"{role}:{socket.gethostname()}:{os.getpid()}:"


def read_ledger(conn: Connection) -> Ledger:
    now = float(conn.execute(select(db_now())).scalar_one())
    announced = {r.key_id: (float(r.announced_at), None if r.seals_from is None else float(r.seals_from))
                 for r in conn.execute(select(encryption_keys))}
    readers = tuple(Reader(r.reader_id, r.role, frozenset(filter(None, r.key_ids.split(","))), r.sealing_key_id,
                           int(r.unopenable), float(r.seen_at)) for r in conn.execute(select(encryption_readers)))
    return Ledger(now, announced, readers)


def _upsert(conn: Connection, table: Any, values: dict[str, Any], key: str, update_columns: Iterable[str]) -> None:
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    statement = dialect.insert(table).values(**values)
    columns = list(update_columns)
    statement = (statement.on_conflict_do_update(index_elements=[key], set_={c: statement.excluded[c]
                                                                             for c in columns})
                 if columns else statement.on_conflict_do_nothing(index_elements=[key]))
    conn.execute(statement)


def report(conn: Connection, *, reader_id: str, role: str, keys: SealingKeys | None,
           unopenable: int = 0) -> Ledger:
    """Announce this process's key, report what it opens, and return the agreement as it is.

    Runs in the caller's transaction (a producer: the seller's); the reader row is this
    process's own, so no two transactions wait on it.
    """
    ledger = read_ledger(conn)
    now = ledger.now
    if role == "daemon" and any(r.seen_at < now - FORGET_SECONDS for r in ledger.readers):
        conn.execute(delete(encryption_readers).where(encryption_readers.c.seen_at < now - FORGET_SECONDS))
    # Announced the first time only, and never by a process that cannot open the agreed key: a
    # stale configuration's key (often the one a rotation retired) announced now would be the
    # newest, and, opened by every process that keeps it as an old key, agreed again, undoing
    # the rotation. A process rotated as docs/encryption.md says keeps the agreed key among
    # OUTBOX_ENCRYPTION_OLD_KEYS, so it announces.
    agreed = ledger.sealing_key_id
    if keys is not None and keys.active_id not in ledger.announced and (agreed is None or keys.can_open(agreed)):
        _upsert(conn, encryption_keys, {"key_id": keys.active_id, "announced_at": now}, "key_id", ())
        ledger = read_ledger(conn)
    sealing = sealer(keys, ledger.sealing_key_id)
    me = Reader(reader_id, role, frozenset(keys.ids) if keys else frozenset(),
                None if sealing is None else sealing.active_id, unopenable, now)
    _upsert(conn, encryption_readers, {
        "reader_id": reader_id, "role": role, "key_ids": ",".join(sorted(me.key_ids)),
        "sealing_key_id": me.sealing_key_id, "unopenable": unopenable, "seen_at": now},
        "reader_id", ("role", "key_ids", "sealing_key_id", "unopenable", "seen_at"))
    return replace(ledger, readers=(*(r for r in ledger.readers if r.reader_id != reader_id), me))


def forget(conn: Connection, reader_id: str) -> None:
    """A process stopping cleanly stops counting at once (not ``LIVE_SECONDS`` later).

    Its row stays, aged out, so its recent attempts are known to be a reporting process's
    (:func:`adopt` does not wait them out); rows a day old are dropped by :func:`report`.
    """
    conn.execute(update(encryption_readers).where(encryption_readers.c.reader_id == reader_id).values(seen_at=_AGED))


def stop_reporting(engine: Engine) -> None:
    """For a seller process shutting down cleanly: its threads stop counting as live
    readers now, so a rotation under way does not wait ``LIVE_SECONDS`` for them."""
    if not _HAS_TABLES.get(engine):
        return
    with engine.begin() as conn:
        conn.execute(update(encryption_readers).values(seen_at=_AGED).where(
            encryption_readers.c.reader_id.startswith(_process_prefix("producer"), autoescape=True)))
    _VIEWS.pop(engine, None)


def _unreported_lessees(conn: Connection, ledger: Ledger) -> set[str]:
    """Daemons with a lease or a recent attempt that never reported: a release without the agreement."""
    reporting = {r.reader_id for r in ledger.readers}
    leased = conn.execute(select(messages.c.leased_by).distinct().where(messages.c.state == "in_flight"))
    recent = conn.execute(select(attempts.c.daemon_id).distinct()
                          .where(attempts.c.occurred_at >= ledger.now - LIVE_SECONDS))
    return {d for (d,) in [*leased, *recent] if d is not None} - reporting


def adopt(conn: Connection, ledger: Ledger) -> str | None:
    """Make the rotation's new key the sealing key if every live process opens it; its id if so.

    Idempotent and safe from every daemon at once (the update is conditional).
    """
    kid = ledger.candidate()
    if kid is None or ledger.lacking(kid) or _unreported_lessees(conn, ledger):
        return None
    done = conn.execute(update(encryption_keys).where(encryption_keys.c.key_id == kid,
                                                      encryption_keys.c.seals_from.is_(None))
                        .values(seals_from=db_now()))
    return kid if done.rowcount else None


@dataclass
class _View:
    agreed: str | None
    fetched: float


_VIEWS: WeakKeyDictionary[Engine, _View] = WeakKeyDictionary()
_HAS_TABLES: WeakKeyDictionary[Engine, bool] = WeakKeyDictionary()
_REFRESHING = threading.Lock()


def producer_keys(conn: Connection, settings: Settings) -> SealingKeys | None:
    """The keys an enqueue on ``conn`` seals with: the agreed key, read at most every
    ``REFRESH_SECONDS`` (and reported on the same occasion) through the caller's connection.

    A schema without the agreement's tables (``outboxd migrate`` not run yet) seals under
    ``OUTBOX_ENCRYPTION_KEY``, as before the agreement existed.
    """
    keys = settings.sealing()
    if keys is None:
        return None
    engine = conn.engine
    has_tables = _HAS_TABLES.get(engine)
    if has_tables is None:
        has_tables = _HAS_TABLES[engine] = inspect(conn).has_table(encryption_readers.name)
    if not has_tables:
        return keys
    view = _VIEWS.get(engine)
    stale = view is None or time.monotonic() - view.fetched >= REFRESH_SECONDS
    if stale:
        # Never waited for: under outbox.aio the holder may be a coroutine of this very thread,
        # suspended inside this call while its statement runs, and waiting would block the
        # event loop it needs to finish. The holder reports for the process (every thread
        # and coroutine has the same keys); a caller without a view yet only reads the
        # agreement (no row lock to wait on); one with a view uses it meanwhile.
        if _REFRESHING.acquire(blocking=False):
            try:
                ledger = report(conn, reader_id=process_id("producer"), role="producer", keys=keys)
                view = _VIEWS[engine] = _View(ledger.sealing_key_id, time.monotonic())
            finally:
                _REFRESHING.release()
        elif view is None:
            view = _View(read_ledger(conn).sealing_key_id, 0.0)  # this call's own: not kept
    return sealer(keys, None if view is None else view.agreed)
