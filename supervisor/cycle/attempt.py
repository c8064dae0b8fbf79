"""One delivery attempt of one leased message: check, sign, POST, classify.

Pure of database writes: it returns an :class:`Outcome` for the completer to record, so
the attempt and the message's new state are written together in one transaction.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass

from outbox import protocol
from outbox.config import Settings
from outbox.errors import ConfigurationError, OutboxValidationError
from outbox.leases import Claimed
from outbox.masking import response_excerpt
from outbox.identity import escapes_lone_surrogate
from outbox.producer import decode_body
from outbox.sealing import CREDENTIAL, KeyUnavailable, SealError, plaintext
from outbox.urls import validate_destination
from supervisor.cycle import challenge
from supervisor.wire.classify import Verdict, classify_response, classify_transport_error
from supervisor.wire.signing import CONTENT_TYPE, Clock, KeySource, bearer_headers, hmac_headers, signature_headers
from supervisor.wire.http1 import ERROR_BODY_KEPT
from supervisor.wire.transport import HttpSender


@dataclass(frozen=True)
class Outcome:
    """What happened to one leased message, ready to be recorded."""

    message: Claimed
    # delivered | retry | dead, or, with no request made and no attempt row: expire (past
    # its horizon when its request would start) | release (the half-open probe went to another
    # daemon) | hold (the daemon cannot sign now, or lacks the key a body or credential is
    # sealed under: due again shortly, for any daemon)
    action: str
    outcome: str  # attempt outcome: success | failed | timeout | connection_error | abandoned
    reason: str | None = None  # dead reason
    http_status: int | None = None
    error: str | None = None
    response_time_ms: int | None = None
    retry_after: float | None = None
    sent: bool = False  # a request was made: counts for the circuit breaker
    trace: tuple[str, str] | None = None  # (trace id, span id) of the attempt's span, when tracing is on
    # The start of a non-2xx answer's body, sanitized and masked (outbox.masking): for the
    # attempt row only, never a log line, a metric or a buyer's activity record.
    response_excerpt: str | None = None

    @classmethod
    def held(cls, message: Claimed, error: str) -> "Outcome":
        return cls(message, "hold", "held", error=error[:200])

    @classmethod
    def dead(cls, message: Claimed, reason: str, error: str) -> "Outcome":
        return cls(message, "dead", "failed", reason=reason, error=error[:200])


class UnusableCredential(ValueError):
    """A stored legacy credential that opens but can never be sent: the message is invalid."""


class PreparationError(Exception):
    """The attempt cannot be made now for a reason of the daemon's, not the message's: the
    message waits (no attempt made or counted) until the operator fixes it."""


def opened(message: Claimed, settings: Settings) -> Claimed:
    """``message`` with the exact bytes to send: its sealed body opened, in memory only.

    The stored hash covers the stored bytes, so it is checked first; a body that does not
    open raises :class:`SealError`: tampering or a blob moved from another row end the
    message ``dead invalid``; a key this process lacks (:class:`KeyUnavailable`) holds it.
    """
    if message.body_sha256 is not None and hashlib.sha256(message.body).digest() != message.body_sha256:
        raise SealError("body does not match its stored SHA-256")
    if message.body_key_id is None:
        return message
    return dataclasses.replace(message, body=plaintext(message, settings.sealing()), body_key_id=None)


def integrity_problem(message: Claimed, settings: Settings) -> tuple[str | None, str]:
    """Why an opened row cannot be sent as stored (``None`` if it can) and its canonical URL.

    Rows may come from a plain-SQL producer in any language, so the daemon trusts
    nothing: the body must be a JSON object carrying the row's key, and the URL must pass
    the same rules as enqueue.
    """
    if len(message.body) > protocol.MAX_BODY_BYTES:
        return "body is over the 1 MiB limit", message.url
    body = decode_body(message.body)
    if body is None:
        return "body is not a JSON object", message.url
    if escapes_lone_surrogate(message.body, body):
        return "body escapes an unpaired surrogate (\\uD800-\\uDFFF alone): not valid Unicode", message.url
    if challenge.is_challenge(message.notification_type):
        problem = challenge.body_problem(body, message.auth_mode)
        if problem is not None:
            return problem, message.url
    elif body.get("idempotency_key") != message.idempotency_key:
        return "idempotency_key in the body differs from the row", message.url
    if not protocol.IDEMPOTENCY_KEY_RE.fullmatch(message.idempotency_key):
        return "idempotency_key does not match the AdCP pattern", message.url
    try:
        url = validate_destination(message.url, allow_http=settings.allow_http, allowed_cidrs=settings.allowed_cidrs)
    except OutboxValidationError as exc:
        return str(exc), message.url
    if message.auth_mode != "rfc9421" and message.auth_secret is None:
        return "legacy authentication without stored credentials", url
    return None, url


def auth_headers(message: Claimed, url: str, settings: Settings, keys: KeySource,
                 clock: Clock = time.time) -> dict[str, str]:
    """Transport metadata for this attempt: the only thing that changes between attempts.

    RFC 9421 unless the buyer registered legacy ``authentication`` — never both
    (docs/protocol.md "Legacy credentials").
    Raises :class:`SealError` for credentials that do not open (:class:`KeyUnavailable` when
    this process lacks their key), :class:`UnusableCredential`
    for ones that cannot be a header, and :class:`PreparationError` when the daemon lacks a key.
    """
    if message.auth_mode == "rfc9421":
        try:
            key = keys.resolve(message.tenant_id)
        except ConfigurationError as exc:
            raise PreparationError(str(exc)) from None
        return signature_headers(key, url=url, body=message.body, clock=clock)
    sealing = settings.sealing()
    if sealing is None:
        raise KeyUnavailable("legacy credentials are sealed but OUTBOX_ENCRYPTION_KEY is not set: set it "
                             "(docs/encryption.md)")
    assert message.auth_secret is not None
    secret = sealing.open(CREDENTIAL, message.auth_secret, tenant_id=message.tenant_id,
                       idempotency_key=message.idempotency_key)
    if not protocol.LEGACY_CREDENTIAL_RE.fullmatch(secret.decode("latin-1")):
        # Enqueue refuses these; a plain-SQL or older row may still hold one, and it can never
        # become a header: dead now rather than a crash or a retry loop to the horizon.
        raise UnusableCredential("stored legacy credential is not visible ASCII")
    if message.auth_mode == "hmac":
        return {"Content-Type": CONTENT_TYPE, **hmac_headers(secret, message.body, clock=clock)}
    return {"Content-Type": CONTENT_TYPE, **bearer_headers(secret.decode())}


async def attempt(message: Claimed, *, settings: Settings, keys: KeySource, sender: HttpSender,
                  clock: Clock = time.time) -> Outcome:
    """Make one attempt; never raises for anything the message or the receiver does.

    ``clock`` stamps the signature; the daemon passes its database-corrected one.
    """
    try:
        message = opened(message, settings)
    except KeyUnavailable as exc:
        return Outcome.held(message, str(exc))
    except SealError as exc:
        return Outcome.dead(message, "invalid", str(exc))
    problem, url = integrity_problem(message, settings)
    if problem is not None:
        return Outcome.dead(message, "invalid", problem)
    try:
        headers = auth_headers(message, url, settings, keys, clock)
    except KeyUnavailable as exc:
        return Outcome.held(message, str(exc))
    except (SealError, UnusableCredential) as exc:
        return Outcome.dead(message, "invalid", str(exc))
    except PreparationError as exc:  # the daemon's to fix (a key): wait, burning no attempt
        return Outcome.held(message, str(exc))
    # Judged as the request starts, in the database's time (the claim's, carried forward): a
    # message that waited for a slot, or a lease, may have reached its horizon meanwhile. The
    # request's bytes go out once connected, so it starts only if even the slowest connect
    # allowed ends before the horizon: nothing reaches a receiver past enqueue + horizon.
    if message.db_time() + settings.connect_timeout_seconds >= message.retry_until:
        return Outcome(message, "expire", "expired", reason="expired", error="retry horizon passed")
    result = await sender.post(url, message.body, headers)
    verdict: Verdict
    if result.status is None:
        verdict = classify_transport_error(result.error_kind or "connection_error")
    else:
        verdict = classify_response(result.status, result.headers, now=message.db_time(),
                                    retry_after_cap=settings.retry_after_cap_seconds)
    if challenge.is_challenge(message.notification_type):
        verdict = challenge.judge(verdict, attempt=message.attempt, challenge_body=message.body,
                                  response_body=result.body, max_attempts=settings.proof_max_attempts)
    # The verdict's words for an answer (and for a proof that failed), else the transport's.
    error = verdict.detail if result.status is not None or verdict.reason == "proof_failed" else result.error
    error = None if verdict.action == "delivered" else error
    failed_answer = result.status is not None and not 200 <= result.status <= 299 and result.body
    return Outcome(
        message, verdict.action, verdict.outcome, reason=verdict.reason, http_status=result.status,
        error=error[:200] if error else None, response_time_ms=result.elapsed_ms,
        retry_after=verdict.retry_after, sent=result.sent,
        response_excerpt=response_excerpt(result.body, cut=len(result.body) >= ERROR_BODY_KEPT)
        if failed_answer else None,
    )
