"""What a receiver's answer means: the protocol rules for outcomes, in one place.

Every rule here names the section of docs/protocol.md (and through it the public spec page)
it implements, so a change in the AdCP spec is one edit in this file:

* which HTTP statuses are delivered, retried or dead ("Receiver answers", "Destinations (SSRF)");
* how a transport failure (timeout, refused connection, SSRF block) is treated ("Destinations (SSRF)");
* how ``Retry-After`` is read (RFC 9110 §10.2.3; the AdCP spec gives it no meaning, "Receiver answers",
  so we honour it only as a hint for *when* to retry, never for *whether*);
* how the ``WWW-Authenticate: Signature error="webhook_*"`` code is extracted ("Receiver answers");
* the retry back-off schedule, and the last try it keeps inside the horizon ("Retry horizon").

The functions are pure: no I/O, no clock reads (the caller passes ``now``), no logging.
None of them raises on hostile receiver input; the texts they return (``detail``, the
signature error code) are short and built from a fixed vocabulary or a sanitized code,
so they are safe to put in attempt rows, logs and metrics labels (docs/architecture.md, "Failure isolation").
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timezone
from email.utils import parsedate_to_datetime
from typing import Literal

__all__ = [
    "Verdict",
    "RetryPolicy",
    "classify_response",
    "classify_transport_error",
    "parse_retry_after",
    "signature_error_code",
]

Action = Literal["delivered", "retry", "dead"]


@dataclass(frozen=True)
class Verdict:
    """The decision about one attempt.

    ``reason`` is set only when ``action == "dead"``: one of ``conflict``,
    ``signature_rejected``, ``gone``, ``rejected``, ``blocked`` (the message-level reasons
    ``expired`` and ``invalid`` are decided elsewhere, not from a response).
    ``outcome`` is the per-attempt ``status`` of the webhook-activity-record (docs/protocol.md "Attempt records"):
    ``success`` | ``failed`` | ``timeout`` | ``connection_error``.
    ``retry_after`` is the receiver's ``Retry-After`` in seconds, already capped; it is set
    only on ``retry`` verdicts. The scheduler should wait at least that long (and at least
    its own back-off): it is a hint about *when*, it never turns a dead verdict into a retry.
    ``detail`` is a short, secret-free text for the attempt row, e.g. ``"HTTP 503"``.
    """

    action: Action
    reason: str | None
    outcome: str
    retry_after: float | None
    detail: str | None


# --------------------------------------------------------------------------- headers


def _header(headers: Mapping[str, str], name: str) -> str | None:
    """Case-insensitive header lookup that works for plain dicts and httpx.Headers alike.

    HTTP field names are case-insensitive (RFC 9110 §5.1); callers may hand us a dict
    with lower-cased, canonical-cased or mixed keys.
    """
    try:
        value = headers.get(name)
        if value is None:
            value = headers.get(name.lower())
        if value is None:
            wanted = name.lower()
            for key, candidate in headers.items():
                if isinstance(key, bytes):
                    key = key.decode("latin-1")
                if isinstance(key, str) and key.lower() == wanted:
                    value = candidate
                    break
    except Exception:  # a weird Mapping must not break classification
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return value if isinstance(value, str) else None


# --------------------------------------------------------------------------- Retry-After

# RFC 9110 §5.6.7 HTTP-date: IMF-fixdate, and the obsolete rfc850-date and asctime-date.
# We check the shape first (so email.utils' very lenient parser never turns noise into a
# date), then let email.utils do the arithmetic. Names are matched case-insensitively:
# the RFC makes HTTP-date case-sensitive, but a lenient reader costs nothing here.
_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_DAY_LONG = r"(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)"
_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
_TIME = r"[0-9]{2}:[0-9]{2}:[0-9]{2}"
_HTTP_DATE = re.compile(
    rf"(?:{_DAY}, [0-9]{{2}} {_MONTH} [0-9]{{4}} {_TIME} GMT"  # IMF-fixdate
    rf"|{_DAY_LONG}, [0-9]{{2}}-{_MONTH}-[0-9]{{2}} {_TIME} GMT"  # rfc850-date
    rf"|{_DAY} {_MONTH} (?: [0-9]|[0-9]{{2}}) {_TIME} [0-9]{{4}})",  # asctime-date
    re.IGNORECASE | re.ASCII,
)
_DELTA_SECONDS = re.compile(r"[0-9]+", re.ASCII)
# More digits than this is "longer than any cap": skip int() (which refuses >4300 digits
# and is slow well before that) and go straight to the cap.
_MAX_DELTA_DIGITS = 15


def parse_retry_after(value: str | None, *, now: float, cap: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` field value, or ``None`` if absent or invalid.

    RFC 9110 §10.2.3: ``Retry-After = HTTP-date / delay-seconds``, ``delay-seconds`` being
    ``1*DIGIT``. A date in the past (or now) means "retry now": ``0.0``. The result is
    clamped to ``[0, cap]`` (a negative ``cap`` counts as 0). ``now`` is Unix seconds.
    Never raises on any ``str``: a receiver's garbage is simply ``None``.
    """
    if not isinstance(value, str):
        return None
    cap = max(float(cap), 0.0) if not math.isnan(cap) else 0.0
    text = value.strip(" \t")
    if not text:
        return None
    if _DELTA_SECONDS.fullmatch(text):
        if len(text.lstrip("0")) > _MAX_DELTA_DIGITS:
            return cap
        return min(float(int(text)), cap)
    if not _HTTP_DATE.fullmatch(text):
        return None
    try:
        when = parsedate_to_datetime(text)
        if when.tzinfo is None:  # asctime-date carries no zone; HTTP-dates are all GMT
            when = when.replace(tzinfo=timezone.utc)
        delta = when.timestamp() - now
    except Exception:  # e.g. "Mon, 31 Feb 2024 ..." -> ValueError; never propagate
        return None
    if math.isnan(delta):
        return None
    return min(max(delta, 0.0), cap)


# --------------------------------------------------------------------------- WWW-Authenticate

# RFC 9110 §11.6.1: WWW-Authenticate = #challenge; challenge = auth-scheme [ 1*SP ( token68 /
# #auth-param ) ]; auth-param = token BWS "=" BWS ( token / quoted-string ). Commas separate
# both challenges and parameters, so we tokenize: a bare token not followed by "=" starts a
# new challenge, "name = value" belongs to the current one.
_DELIMS = frozenset(' \t,="')
_SAFE_CODE = re.compile(r"[^a-z0-9_]")
_MAX_CODE_LEN = 80
_WEBHOOK_PREFIX = "webhook_"


def signature_error_code(www_authenticate: str | None) -> str | None:
    """The ``error="webhook_..."`` code of a ``Signature`` challenge, or ``None``.

    docs/protocol.md "Receiver answers": receivers answer verification failures with ``401`` and
    ``WWW-Authenticate: Signature error="<code>"``; only codes starting with ``webhook_``
    count. Tolerates any case for the scheme and parameter name, extra spacing, quoted or
    token values and several challenges in one header (``Bearer realm="x", Signature
    error="webhook_signature_invalid"``). The code is returned lower-cased with anything
    outside ``[a-z0-9_]`` replaced by ``_`` and cut to 80 characters, so it is safe to log.
    Never raises.
    """
    if not isinstance(www_authenticate, str):
        return None
    try:
        return _signature_error_code(www_authenticate)
    except Exception:  # pragma: no cover - the tokenizer below is total; belt and braces
        return None


def _signature_error_code(text: str) -> str | None:
    n = len(text)
    i = 0
    scheme: str | None = None

    def skip_ws(j: int) -> int:
        while j < n and text[j] in " \t":
            j += 1
        return j

    while i < n:
        c = text[i]
        if c in " \t,":
            i += 1
            continue
        if c in '="':  # stray delimiter (or a value with no name): skip it
            if c == '"':
                _, i = _quoted(text, i)
            else:
                i += 1
            continue
        start = i
        while i < n and text[i] not in _DELIMS:
            i += 1
        token = text[start:i]
        j = skip_ws(i)
        if j >= n or text[j] != "=":
            scheme = token.lower()  # a bare token: the next challenge's auth-scheme
            i = j
            continue
        # "name =" ... either an auth-param or a token68 ending in "=" padding.
        j = skip_ws(j + 1)
        if j >= n or text[j] in ",=":
            while j < n and text[j] == "=":
                j += 1
            i = j
            continue
        if text[j] == '"':
            value, i = _quoted(text, j)
        else:
            k = j
            while k < n and text[k] not in _DELIMS:
                k += 1
            value, i = text[j:k], k
        if scheme == "signature" and token.lower() == "error":
            code = value.strip().lower()
            if code.startswith(_WEBHOOK_PREFIX):
                return _SAFE_CODE.sub("_", code)[:_MAX_CODE_LEN]
    return None


def _quoted(text: str, i: int) -> tuple[str, int]:
    """Read the quoted-string starting at ``text[i] == '"'``; tolerate a missing close."""
    out: list[str] = []
    i += 1
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            out.append(text[i + 1])
            i += 2
            continue
        if c == '"':
            return "".join(out), i + 1
        out.append(c)
        i += 1
    return "".join(out), i


# --------------------------------------------------------------------------- classification

# docs/protocol.md "Receiver answers": retried even though they are 4xx — 408 Request Timeout, 425 Too Early,
# 429 (the receiver's dedup bound: "retry later"). The SDK uses the same set.
_RETRYABLE_4XX = frozenset({408, 425, 429})


def _retry(status: int, headers: Mapping[str, str], now: float, cap: float, detail: str) -> Verdict:
    retry_after = parse_retry_after(_header(headers, "Retry-After"), now=now, cap=cap)
    return Verdict("retry", None, "failed", retry_after, detail)


def _dead(reason: str, detail: str) -> Verdict:
    return Verdict("dead", reason, "failed", None, detail)


def classify_response(
    status: int, headers: Mapping[str, str], *, now: float, retry_after_cap: float
) -> Verdict:
    """Decide what an HTTP answer means for the message (docs/protocol.md "Receiver answers").

    ======================  ==========================================================
    2xx                     delivered — a durably completed duplicate also answers 2xx
                            ("Idempotency", "Receiver answers")
    409                     dead ``conflict`` — same key, different payload: stop ("Receiver answers")
    401 + ``Signature       dead ``signature_rejected`` — terminal for this delivery ("Receiver answers")
    error="webhook_*"``
    410                     dead ``gone`` — the SDK's reading; the spec is silent ("Receiver answers")
    3xx                     dead ``rejected`` — redirects are never followed ("Destinations (SSRF)")
    408, 425, 429, 5xx      retry ("Receiver answers": 503 = identical delivery in progress, 429 = dedup
                            bound)
    plain 401, 403          retry — persistent channels: "SHOULD be treated as transient
                            and retried ... without auto-disabling" ("Receiver answers")
    other 4xx               dead ``rejected`` (includes 413, "Sizes and timeouts")
    anything else           retry as ``failed`` (1xx final status, >599: not a verdict)
    ======================  ==========================================================

    ``Retry-After`` is read (case-insensitively) only for retry verdicts, and capped at
    ``retry_after_cap`` seconds; ``now`` is the Unix time the answer arrived.
    """
    detail = f"HTTP {status}"
    if 200 <= status <= 299:
        return Verdict("delivered", None, "success", None, detail)
    if 300 <= status <= 399:
        # docs/protocol.md "Destinations (SSRF)"; the SDK treats 3xx as permanent (docs/protocol.md "Receiver answers").
        return _dead("rejected", f"{detail} redirect not followed")
    if status == 409:
        return _dead("conflict", detail)
    if status == 410:
        return _dead("gone", detail)
    if status in (401, 403):
        code = signature_error_code(_header(headers, "WWW-Authenticate"))
        if code is not None:
            detail = f"{detail} {code}"
            if status == 401:
                # docs/protocol.md "Receiver answers": "MUST treat a 401 carrying WWW-Authenticate: Signature
                # error="webhook_*" as terminal for that delivery".
                return _dead("signature_rejected", detail)
        # docs/protocol.md "Receiver answers": any other 401 (and 403) is an auth-renewal problem on a
        # persistent channel — retry per the schedule, bounded by the horizon (docs/protocol.md "Retry horizon").
        return _retry(status, headers, now, retry_after_cap, detail)
    if status in _RETRYABLE_4XX or 500 <= status <= 599:
        return _retry(status, headers, now, retry_after_cap, detail)
    if 400 <= status <= 499:
        return _dead("rejected", detail)
    # 1xx as a final status, or outside 100..599: not a meaningful answer; try again.
    return _retry(status, headers, now, retry_after_cap, detail)


# Kinds the HTTP sender reports when no response was received.
_TRANSPORT_VERDICTS: dict[str, Verdict] = {
    # docs/protocol.md "Receiver answers": "5xx / 408 / 425 / 429 / network errors -> retry with backoff".
    "timeout": Verdict("retry", None, "timeout", None, "timeout"),
    "connection_error": Verdict("retry", None, "connection_error", None, "connection error"),
    "protocol_error": Verdict("retry", None, "connection_error", None, "protocol error"),
    # docs/protocol.md "Destinations (SSRF)": the destination resolved to a blocked address (or is not allowed at all).
    # Nothing was sent; retrying cannot help. No address is echoed (docs/protocol.md "Destinations (SSRF)").
    "blocked": Verdict("dead", "blocked", "connection_error", None, "destination blocked"),
    # The request httpx would send does not carry the signed @target-uri: the buyer would
    # answer webhook_signature_invalid. Nothing was sent; the stored URL itself is at fault.
    "invalid": Verdict("dead", "invalid", "failed", None, "request target differs from the signed URL"),
}


def classify_transport_error(error_kind: str) -> Verdict:
    """Decide what a failure without an HTTP response means.

    ``"timeout"`` → retry (activity status ``timeout``); ``"connection_error"`` and
    ``"protocol_error"`` → retry (``connection_error``); ``"blocked"`` (SSRF policy refused
    the destination, docs/protocol.md "Destinations (SSRF)") → dead ``blocked``; ``"invalid"``
    (the request target would not be the signed one) → dead ``invalid``. An unknown kind is retried as a
    ``connection_error``: at-least-once delivery prefers a resend to a silent drop.
    """
    verdict = _TRANSPORT_VERDICTS.get(error_kind)
    if verdict is not None:
        return verdict
    return Verdict("retry", None, "connection_error", None, "transport error")


# --------------------------------------------------------------------------- back-off


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential back-off between attempts of one message (docs/protocol.md "Retry horizon").

    The seed SDK's name, with defaults tuned for AdCP: the conformance runner answers 503
    three times and requires >= 2 deliveries within 90 s ("Retry horizon"), so the first retry
    comes after 2–2.5 s and the fourth attempt lands within ~18 s. The spec gives no numeric
    schedule; the ceiling is the retry horizon, enforced by the caller.

    Jitter is add-only (up to +25 %): a delay is never shorter than the schedule, so a
    receiver is never hit earlier than planned. ``max_delay_seconds`` caps the schedule,
    and the jitter goes on top of the cap too (so a capped delay is at most 1.25 × the
    cap): otherwise every message at the cap would retry in lockstep.
    """

    base_delay_seconds: float = 2.0
    max_delay_seconds: float = 3600.0
    jitter: bool = True

    def __post_init__(self) -> None:
        if not (self.base_delay_seconds >= 0 and math.isfinite(self.base_delay_seconds)):
            raise ValueError("base_delay_seconds must be a finite number >= 0")
        if not (self.max_delay_seconds >= self.base_delay_seconds and math.isfinite(self.max_delay_seconds)):
            raise ValueError("max_delay_seconds must be finite and >= base_delay_seconds")

    def delay_for_attempt(self, attempts_made: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before the next attempt, after ``attempts_made`` failed ones.

        ``base * 2**(attempts_made - 1)`` capped at ``max_delay_seconds``, plus jitter of
        up to 25 % of that. ``attempts_made < 1`` is treated as 1.
        """
        exponent = min(max(attempts_made, 1) - 1, 64)  # 2**64 * base is past any sane cap
        delay = min(self.base_delay_seconds * float(2**exponent), self.max_delay_seconds)
        if self.jitter:
            fraction = (rng if rng is not None else random).random()
            delay *= 1.0 + 0.25 * fraction
        return delay


# A retry whose back-off would pass the horizon gets one last attempt this long before it
# (time for a claim and a full request), instead of being given up at once.
LAST_TRY_MARGIN_SECONDS = 60.0


def retry_at(now: float, delay: float, horizon_end: float) -> float | None:
    """When to try again after a failure, or ``None`` when the horizon leaves no more tries.

    Never past the horizon: a back-off that comes before it is kept (also in the horizon's
    last minute: the attempt itself starts only if its connect ends before the horizon), and
    one that would overshoot it becomes one last attempt ``LAST_TRY_MARGIN_SECONDS`` before
    it, or none when the failure came later than that.
    """
    if now + delay < horizon_end:
        return now + delay
    last = horizon_end - LAST_TRY_MARGIN_SECONDS
    return last if now < last else None
