"""URL proof for account-level subscribers: judging ``webhook.challenge`` answers, settling proofs.

A challenge is an ordinary outbox message (``notification_type = "webhook.challenge"``),
so it is signed (always RFC 9421), retried with back-off and recorded attempt by attempt
like any other. What differs is what counts as delivered: a 2xx whose JSON body echoes
the challenge value in exactly one of ``challenge`` or ``token``
(https://adcontextprotocol.org/schemas/3.2.4/core/webhook-challenge-response.json). A URL
gets ``OUTBOX_PROOF_MAX_ATTEMPTS`` tries; then the proof has failed.

When a challenge ends, however it ends (answered, refused, out of attempts, or past its
horizon before a request could start), the completer or maintenance settles it in the same
transaction: the subscriber becomes ``active`` and its held fires due now, or
``proof_failed`` and its held fires dead ``proof_failed``. Only the subscriber's current
challenge counts: one superseded by a re-registration settles nothing.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox import protocol, store
from outbox.producer import decode_body
from outbox.schema import db_now, messages, subscribers
from outbox.subscribers import fail_held, release_held
from supervisor.observe import events
from supervisor.wire.classify import Verdict
from supervisor.observe.metrics import Metrics


def is_challenge(notification_type: str | None) -> bool:
    return notification_type == protocol.CHALLENGE_TYPE


def body_problem(body: dict[str, Any], auth_mode: str) -> str | None:
    """Why a stored challenge cannot be sent (``None`` if it can); it has no idempotency_key."""
    if body.get("type") != protocol.CHALLENGE_TYPE:
        return "challenge body is not a webhook.challenge"
    value = body.get("challenge")
    if not isinstance(value, str) or not protocol.CHALLENGE_RE.fullmatch(value):
        return "challenge value does not match the AdCP pattern"
    if auth_mode != "rfc9421":
        return "a challenge is always RFC 9421-signed"
    return None


def echo_problem(challenge_body: bytes, response_body: bytes) -> str | None:
    """Why a 2xx answer does not prove control of the URL (``None``: it does)."""
    expected = (decode_body(challenge_body) or {}).get("challenge", "")
    answer = decode_body(response_body)
    if answer is None:
        return "challenge answer is not a JSON object"
    echoed = [answer[name] for name in protocol.CHALLENGE_ECHO_FIELDS if name in answer]
    if len(echoed) != 1 or not isinstance(echoed[0], str):
        return "challenge answer must carry exactly one of challenge or token"
    if not hmac.compare_digest(echoed[0].encode(), str(expected).encode()):
        return "challenge not echoed"
    return None


def judge(verdict: Verdict, *, attempt: int, challenge_body: bytes, response_body: bytes,
          max_attempts: int) -> Verdict:
    """A challenge attempt's verdict: 2xx without the echo is a failed attempt, and the last
    allowed attempt that does not prove the URL ends the proof (dead ``proof_failed``)."""
    if verdict.action == "delivered":
        problem = echo_problem(challenge_body, response_body)
        if problem is None:
            return verdict
        verdict = Verdict("retry", None, "failed", None, f"{verdict.detail}: {problem}")
    if verdict.action == "retry" and attempt >= max_attempts:
        return Verdict("dead", "proof_failed", verdict.outcome, None,
                       f"{verdict.detail}; URL proof failed after {attempt} attempts")
    return verdict


@dataclass
class Settled:
    """What settling a batch of finished challenges did, for the metrics (counted after commit)."""

    proven: int = 0  # subscribers now active
    failed: int = 0  # subscribers now proof_failed
    released: int = 0  # held fires made due
    dead_fires: list[str] = field(default_factory=list)  # tenant of each held fire ended dead proof_failed

    def count(self, metrics: Metrics) -> None:
        for outcome, n in (("proven", self.proven), ("failed", self.failed)):
            if n:
                metrics.proofs.labels(outcome=outcome).inc(n)
        if self.released:
            metrics.held_fires.labels(outcome="released").inc(self.released)
        for tenant in self.dead_fires:
            metrics.held_fires.labels(outcome="dead").inc()
            metrics.count_dead("proof_failed", tenant)


async def settle(conn: AsyncConnection, proven: Sequence[int], failed: Sequence[int]) -> Settled:
    """Record finished challenges (message ids): their subscribers become ``active`` (held
    fires due now) or ``proof_failed`` (held fires dead). Ids of other messages are ignored."""
    settled = Settled()
    for message_ids, state in ((proven, "active"), (failed, "proof_failed")):
        if not message_ids:
            continue
        values: dict[str, Any] = {"state": state, "updated_at": db_now()}
        if state == "active":
            values.update(proven_sha256=subscribers.c.config_sha256, proven_at=db_now())
        s = subscribers.c
        result = list(await conn.execute(
            update(subscribers).where(s.challenge_message_id.in_(list(message_ids)), s.state == "pending_proof")
            .values(**values).returning(s.id, s.tenant_id, s.account_id, s.subscriber_id, s.url,
                                        s.challenge_message_id)))
        refs = [r.id for r in result]
        if not refs:
            continue
        if state == "active":
            settled.proven += len(refs)
            settled.released += (await conn.execute(release_held(refs))).rowcount
        else:
            settled.failed += len(refs)
            ended = await conn.execute(fail_held(refs, "subscriber URL proof failed").returning(messages.c.tenant_id))
            settled.dead_fires += [r.tenant_id for r in ended]
            await events.proofs_failed(conn, result, await store.db_now(conn))
    if settled.released:
        await store.notify(conn)  # wake idle daemons: the released fires are due now
    return settled
