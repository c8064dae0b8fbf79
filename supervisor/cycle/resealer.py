"""The daemon's side of the encryption keys: report, agree, re-seal, and say what it cannot open.

Every ``REFRESH_SECONDS`` the daemon reports the key ids it opens and, when a rotation is
under way, makes the new key the sealing key once every live process opens it
(:mod:`outbox.keyset`). Each ``IDLE_SECONDS`` (each tick while rows are left to move) it
re-seals, in short batches each its own transaction, what is not under the agreed key:
message bodies with their legacy credentials, rows a plain-SQL producer wrote in plaintext,
and subscriber credentials. It counts the messages still to deliver that it cannot open
(sealed under a key missing from its configuration): they are held, never ended, and the
count is a gauge, a ``/readyz`` line and an error log line naming the fix.
``outboxd encryption reseal`` runs the same batches on demand (docs/encryption.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.bodies import not_under, reseal_batch, reseal_subscribers, unopenable_rows
from outbox.config import Settings
from outbox.keyset import REFRESH_SECONDS, Ledger, adopt, forget, report, sealer
from outbox.schema import messages
from outbox.sealing import SealingKeys
from supervisor.observe.metrics import Metrics
from supervisor.cycle.halting import Halt
from supervisor.cycle.outage import OutageGuard

IDLE_SECONDS = 10.0  # between passes while nothing is left to re-seal
BATCH = 200
BACKLOG_COUNT_LIMIT = 100_000  # the gauge counts the rows left to re-seal up to this many
REPORTING = "report encryption keys"
RESEALING = "re-seal stored values"
FIX = ("add the key that sealed them to OUTBOX_ENCRYPTION_OLD_KEYS (or OUTBOX_ENCRYPTION_KEY) and restart; "
       "`outboxd encryption status` names it (docs/encryption.md)")


async def reseal_all(engine: AsyncEngine, keys: SealingKeys, *, batch: int = BATCH,
                     still: Callable[[], bool] = lambda: True) -> tuple[int, list[int]]:
    """One pass over every sealed value: re-seal what is not under ``keys``' active key;
    (count, ids of messages and subscribers that do not open here). The pass ends early
    once ``still()`` is false between batches (another key was agreed meanwhile)."""
    total, failed, after = 0, [], 0
    while still():
        async with engine.begin() as conn:
            done, last, bad = await reseal_batch(conn, keys, after_id=after, limit=batch)
        total += done
        failed += bad
        if last is None:
            break
        after = last
        await asyncio.sleep(0)  # let deliveries run between batches
    async with engine.begin() as conn:
        done, bad = await reseal_subscribers(conn, keys)
    return total + done, failed + bad


def held_line(count: int, who: str = "this process") -> str | None:
    """The one line ``/readyz``, the log and ``outboxd status`` give when rows are held."""
    if not count:
        return None
    return f"{count} message(s) to deliver are sealed under a key {who} lacks: held, not sent; {FIX}"


class Resealer:
    def __init__(self, engine: AsyncEngine, settings: Settings, *, reader_id: str, outage: OutageGuard,
                 metrics: Metrics, halt: Halt | None = None) -> None:
        self._engine = engine
        self._keys = settings.sealing()
        self._reader_id = reader_id
        self._outage = outage
        self._metrics = metrics
        self._log = structlog.get_logger("outboxd.resealer")
        self.agreed: str | None = None
        self.unopenable = 0
        self._resealed_under: str | None = None
        self._failed: list[int] = []
        self._backlog = False
        self._halt = halt or Halt()  # the daemon's stop (supervisor/cycle/halting.py)
        self.yielding: str | None = None  # why this daemon leaves claims to others (it lacks the agreed key)

    @property
    def sealing(self) -> SealingKeys | None:
        """The keys this daemon re-seals with: the agreed key, when it has it."""
        keys = sealer(self._keys, self.agreed)
        return keys if keys is not None and self.agreed == keys.active_id else None

    async def tick(self) -> Ledger:
        """Report, agree on a rotation's new key when every live process opens it, count what is held."""
        async with self._engine.begin() as conn:
            ledger = await conn.run_sync(lambda c: report(c, reader_id=self._reader_id, role="daemon",
                                                          keys=self._keys, unopenable=self.unopenable))
            adopted = await conn.run_sync(lambda c: adopt(c, ledger))
            unopenable = await unopenable_rows(conn, self._keys)
            agreed = adopted or ledger.sealing_key_id
            to_reseal = 0
            if agreed is not None:  # the rotation's progress, whether or not this daemon can help it
                left = select(messages.c.id).where(not_under(agreed)).limit(BACKLOG_COUNT_LIMIT).subquery()
                to_reseal = int(await conn.scalar(select(func.count()).select_from(left)) or 0)
        if adopted:
            self._log.info("encryption.key_agreed", key_id=adopted)
        self.agreed = agreed
        self._yield_unless_alone(ledger)
        if unopenable and unopenable != self.unopenable:
            self._log.error("encryption.rows_unopenable", count=unopenable, known_key_ids=list(
                self._keys.ids) if self._keys else [], fix=FIX)
        self.unopenable = unopenable
        candidate = ledger.candidate()
        self._metrics.sealed_unopenable.set(unopenable)
        self._metrics.reseal_backlog.set(to_reseal)
        self._backlog = to_reseal > len(self._failed)  # work this daemon can do: pass again next tick
        self._metrics.rotation_waiting.set(len(ledger.lacking(candidate)) if candidate else 0)
        return ledger

    def _yield_unless_alone(self, ledger: Ledger) -> None:
        """Leave claims to the daemons that open the agreed key, when this one lacks it (a
        stale configuration) and another live daemon has it: claiming, this idle daemon would
        win most due messages only to hold them again, while a daemon that can send them waits."""
        agreed = self.agreed
        lacks = agreed is not None and (self._keys is None or not self._keys.can_open(agreed))
        others = sorted(r.reader_id for r in ledger.live() if r.role == "daemon" and r.reader_id != self._reader_id
                        and agreed in r.key_ids) if lacks else []
        why = (f"this process lacks the agreed encryption key {agreed}: it leaves deliveries to the daemons that "
               f"open it ({', '.join(others[:3])}); {FIX}") if others else None
        if why is not None and self.yielding is None:
            self._log.error("encryption.claims_yielded", key_id=agreed, daemons=others, fix=FIX)
        elif why is None and self.yielding is not None:
            self._log.info("encryption.claims_resumed")
        self.yielding = why

    async def pass_once(self) -> None:
        keys = self.sealing
        if keys is None:
            return
        count, failed = await reseal_all(self._engine, keys,
                                         still=lambda: self.agreed == keys.active_id and not self._halt.is_set)
        if count:
            self._log.info("bodies.resealed", count=count, key_id=keys.active_id)
            self._metrics.bodies_resealed.inc(count)
        if self.agreed != keys.active_id:  # cut short by a new agreement: the next pass starts over
            return
        self._resealed_under = keys.active_id
        if failed != self._failed:
            self._log.warning("bodies.unopenable", count=len(failed), ids=failed[:20], fix=FIX)
            self._failed = failed

    async def run(self) -> None:
        """Report every ``REFRESH_SECONDS`` and re-seal beside it: a pass over a large table
        takes minutes, and a daemon that stopped reporting meanwhile would drop out of the
        live readers, so a rotation could be agreed on a key it cannot open. Returns once
        halted (the daemon's stop), at the end of the transaction under way."""
        loops = [asyncio.create_task(self._report_forever()), asyncio.create_task(self._reseal_forever())]
        try:  # until halted: the first to fail raises its own error (DatabaseUnavailable past the bound)
            done, _ = await asyncio.wait(loops, return_when=asyncio.FIRST_EXCEPTION)
            for loop in done:
                loop.result()
        finally:
            for loop in loops:
                loop.cancel()
            await asyncio.gather(*loops, return_exceptions=True)

    async def _guarded(self, doing: str, work: Callable[[], Awaitable[object]]) -> bool:
        """``work()`` under the outage guard (which waits before a retry, or until halted): whether it succeeded."""
        try:
            await work()
        except Exception as exc:
            await self._halt.failed(self._outage, doing, exc)
            return False
        self._outage.ok(doing)
        return True

    async def _report_forever(self) -> None:
        while not self._halt.is_set:
            if await self._guarded(REPORTING, self.tick):
                await self._halt.pause(REFRESH_SECONDS)

    async def _reseal_forever(self) -> None:
        since_pass = IDLE_SECONDS
        while not self._halt.is_set:
            if since_pass >= IDLE_SECONDS or self.agreed != self._resealed_under or self._backlog:
                if not await self._guarded(RESEALING, self.pass_once):
                    continue
                since_pass = 0.0
            await self._halt.pause(REFRESH_SECONDS)
            since_pass += REFRESH_SECONDS

    async def stop(self) -> None:
        """Stop counting as a reader now, so a rotation does not wait out this process."""
        try:
            async with self._engine.begin() as conn:
                await conn.run_sync(lambda c: forget(c, self._reader_id))
        except Exception:  # the database is away: the row ages out of LIVE_SECONDS instead
            pass
