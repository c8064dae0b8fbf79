"""Replaying finished messages: the one code path behind ``outboxd replay`` and the console.

A replay makes a delivered or dead message due again with the same stored bytes and the
same idempotency key, marked ``trigger='replay'`` (docs/protocol.md, "Idempotency"). Both
front ends select, dry-run and commit through :func:`replay`, so they cannot disagree on
what is eligible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import store
from outbox.db import error_line, reading
from supervisor.operator import ops

CHUNK = 500  # messages per transaction: daemons start on each chunk as it commits
CANCELLED_WHY = "it was cancelled (its subscriber removed, or a cancel job)"  # never sent again
REVOKED_WHY = "its subscriber was removed, paused or moved to another URL"  # never sent there again


@dataclass
class ReplayResult:
    """What a replay did (or, on a dry run, would do)."""

    dry_run: bool
    replayed: list[int] = field(default_factory=list)  # on a dry run: would be replayed
    refused: list[dict[str, Any]] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    more_matched: int = 0  # matches past the filter's limit, left alone
    # Why it stopped part-way: the chunks before it are replayed (committed), the rest not.
    error: str | None = None

    @property
    def complete(self) -> bool:
        """Everything asked for was (or would be) replayed: nothing refused, unknown or left over."""
        return not self.refused and not self.missing and not self.more_matched and self.error is None

    def as_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "would_replay" if self.dry_run else "replayed": self.replayed,
                "refused": self.refused, "missing": self.missing, "more_matched": self.more_matched,
                **({"error": self.error} if self.error is not None else {})}


async def replay(engine: AsyncEngine, *, ids: Sequence[int] = (), filters: ops.Filters | None = None,
                 horizon_seconds: int, force: bool = False, dry_run: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> ReplayResult:
    """Replay ``ids``, or the messages matching ``filters`` (at most its limit).

    ``horizon_seconds`` is ``OUTBOX_RETRY_HORIZON_SECONDS``: a message's horizon counts from
    enqueue, and a forced replay gets a fresh one from now.
    """
    async with reading(engine).begin() as conn:  # the selection only reads: no SQLite write lock for it
        more = 0
        if filters is not None and filters.key and not filters.tenant:
            await ops.one_tenant_uses(conn, filters.key)
        if filters is not None:
            ids = await ops.select_ids(conn, filters)
            more = max(await ops.count_matching(conn, filters) - len(ids), 0)
        candidates = await ops.replay_candidates(conn, ids, horizon_seconds)
    eligible = [c for c in candidates if c["replayable"] and (force or not c["past_horizon"])]
    result = ReplayResult(dry_run=dry_run, more_matched=more,
                          missing=sorted(set(ids) - {c["id"] for c in candidates}),
                          refused=[{"id": c["id"], "state": c["state"],
                                    "why": "past its retry horizon (use --force)" if c["replayable"] else
                                    "its subscriber URL failed its proof" if c["dead_reason"] == "proof_failed"
                                    else CANCELLED_WHY if c["dead_reason"] == "cancelled"
                                    else REVOKED_WHY if c["subscriber_revoked"]
                                    else f"state is {c['state']}"} for c in candidates if c not in eligible])
    if dry_run:
        result.replayed = [c["id"] for c in eligible]
        return result
    for start in range(0, len(eligible), CHUNK):  # one short transaction per chunk
        try:
            async with engine.begin() as conn:
                result.replayed += sorted(await store.replay(  # RETURNING keeps no order: list them by id
                    conn, [c["id"] for c in eligible[start:start + CHUNK]], force=force,
                    horizon_seconds=horizon_seconds))
                await store.notify(conn)
        except Exception as exc:  # the chunks before are committed: say what was done, and why it stopped
            result.error = error_line(exc)
            return result
        if progress is not None and len(eligible) > CHUNK:
            progress(len(result.replayed), len(eligible))
    return result
