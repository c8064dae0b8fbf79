"""Status classification, Retry-After, signature error codes and back-off (supervisor.wire.classify)."""

from __future__ import annotations

import random
import sys
from datetime import datetime, timezone
from email.utils import format_datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

try:
    import supervisor.wire.classify  # noqa: F401
except ImportError:  # running from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from supervisor.wire.classify import (
    RetryPolicy,
    Verdict,
    classify_response,
    classify_transport_error,
    parse_retry_after,
    signature_error_code,
)

NOW = 1_700_000_000.0  # 2023-11-14T22:13:20Z
CAP = 600.0
SIG_INVALID = {"WWW-Authenticate": 'Signature error="webhook_signature_invalid"'}


def classify(status: int, headers: dict[str, str] | None = None) -> Verdict:
    return classify_response(status, headers or {}, now=NOW, retry_after_cap=CAP)


# --------------------------------------------------------------------------- status table

# (status, headers, action, reason, outcome, detail)
STATUS_TABLE = [
    # 2xx delivered
    (200, {}, "delivered", None, "success", "HTTP 200"),
    (201, {}, "delivered", None, "success", "HTTP 201"),
    (202, {}, "delivered", None, "success", "HTTP 202"),
    (204, {}, "delivered", None, "success", "HTTP 204"),
    (299, {}, "delivered", None, "success", "HTTP 299"),
    # 409 conflict
    (409, {}, "dead", "conflict", "failed", "HTTP 409"),
    # 401 + Signature webhook_* -> signature_rejected
    (401, SIG_INVALID, "dead", "signature_rejected", "failed", "HTTP 401 webhook_signature_invalid"),
    (
        401,
        {"www-authenticate": 'Signature error="webhook_signature_key_unknown"'},
        "dead",
        "signature_rejected",
        "failed",
        "HTTP 401 webhook_signature_key_unknown",
    ),
    (
        401,
        {"WWW-AUTHENTICATE": 'Bearer realm="x", signature  ERROR = webhook_mode_mismatch'},
        "dead",
        "signature_rejected",
        "failed",
        "HTTP 401 webhook_mode_mismatch",
    ),
    # 410 gone
    (410, {}, "dead", "gone", "failed", "HTTP 410"),
    # 3xx never followed
    (300, {}, "dead", "rejected", "failed", "HTTP 300 redirect not followed"),
    (301, {"Location": "https://elsewhere.example/"}, "dead", "rejected", "failed", "HTTP 301 redirect not followed"),
    (302, {}, "dead", "rejected", "failed", "HTTP 302 redirect not followed"),
    (304, {}, "dead", "rejected", "failed", "HTTP 304 redirect not followed"),
    (307, {}, "dead", "rejected", "failed", "HTTP 307 redirect not followed"),
    (308, {}, "dead", "rejected", "failed", "HTTP 308 redirect not followed"),
    # 408, 425, 429, 5xx retried
    (408, {}, "retry", None, "failed", "HTTP 408"),
    (425, {}, "retry", None, "failed", "HTTP 425"),
    (429, {}, "retry", None, "failed", "HTTP 429"),
    (500, {}, "retry", None, "failed", "HTTP 500"),
    (502, {}, "retry", None, "failed", "HTTP 502"),
    (503, {}, "retry", None, "failed", "HTTP 503"),
    (504, {}, "retry", None, "failed", "HTTP 504"),
    (599, {}, "retry", None, "failed", "HTTP 599"),
    # plain 401 / 403 retried (persistent channels, docs/protocol.md "Receiver answers")
    (401, {}, "retry", None, "failed", "HTTP 401"),
    (401, {"WWW-Authenticate": 'Bearer realm="adcp", error="invalid_token"'}, "retry", None, "failed", "HTTP 401"),
    (401, {"WWW-Authenticate": 'Signature error="invalid_signature"'}, "retry", None, "failed", "HTTP 401"),
    (401, {"WWW-Authenticate": 'Bearer error="webhook_signature_invalid"'}, "retry", None, "failed", "HTTP 401"),
    (403, {}, "retry", None, "failed", "HTTP 403"),
    (403, SIG_INVALID, "retry", None, "failed", "HTTP 403 webhook_signature_invalid"),
    # other 4xx dead rejected
    (400, {}, "dead", "rejected", "failed", "HTTP 400"),
    (404, {}, "dead", "rejected", "failed", "HTTP 404"),
    (405, {}, "dead", "rejected", "failed", "HTTP 405"),
    (413, {}, "dead", "rejected", "failed", "HTTP 413"),
    (415, {}, "dead", "rejected", "failed", "HTTP 415"),
    (422, {}, "dead", "rejected", "failed", "HTTP 422"),
    (451, {}, "dead", "rejected", "failed", "HTTP 451"),
    (499, {}, "dead", "rejected", "failed", "HTTP 499"),
    # anything else retried as failed
    (100, {}, "retry", None, "failed", "HTTP 100"),
    (103, {}, "retry", None, "failed", "HTTP 103"),
    (199, {}, "retry", None, "failed", "HTTP 199"),
    (600, {}, "retry", None, "failed", "HTTP 600"),
    (999, {}, "retry", None, "failed", "HTTP 999"),
    (0, {}, "retry", None, "failed", "HTTP 0"),
]


@pytest.mark.parametrize(
    ("status", "headers", "action", "reason", "outcome", "detail"),
    STATUS_TABLE,
    ids=[f"{row[0]}-{row[2]}-{i}" for i, row in enumerate(STATUS_TABLE)],
)
def test_status_table(status, headers, action, reason, outcome, detail):
    verdict = classify(status, headers)
    assert verdict == Verdict(action, reason, outcome, None, detail)


def test_every_status_has_a_consistent_verdict():
    for status in range(0, 1000):
        verdict = classify(status)
        assert verdict.action in ("delivered", "retry", "dead"), status
        assert (verdict.reason is None) == (verdict.action != "dead"), status
        assert verdict.outcome == ("success" if verdict.action == "delivered" else "failed"), status
        assert verdict.detail is not None and verdict.detail.startswith(f"HTTP {status}"), status
        assert verdict.retry_after is None, status


# --------------------------------------------------------------------------- Retry-After in verdicts


@pytest.mark.parametrize("status", [408, 425, 429, 500, 503, 401, 403, 103, 600])
@pytest.mark.parametrize("name", ["Retry-After", "retry-after", "RETRY-AFTER", "rEtRy-AfTeR"])
def test_retry_after_honored_on_retry_verdicts_case_insensitively(status, name):
    verdict = classify(status, {name: "120"})
    assert verdict.action == "retry"
    assert verdict.retry_after == 120.0


@pytest.mark.parametrize("status", [200, 204, 301, 400, 404, 409, 410, 413])
def test_retry_after_ignored_on_non_retry_verdicts(status):
    assert classify(status, {"Retry-After": "120"}).retry_after is None
    assert classify(401, {"Retry-After": "120", **SIG_INVALID}).retry_after is None


def test_retry_after_capped_and_date_form_in_verdict():
    assert classify(503, {"Retry-After": "86400"}).retry_after == CAP
    date = format_datetime(datetime.fromtimestamp(NOW + 90, tz=timezone.utc), usegmt=True)
    assert classify(429, {"retry-after": date}).retry_after == pytest.approx(90.0)
    assert classify(503, {"Retry-After": "soon"}).retry_after is None


def test_headers_from_httpx_like_mapping():
    class CIHeaders(dict):
        """Keys stored in canonical case; .get is case-sensitive (like a plain dict)."""

    headers = CIHeaders({"Www-Authenticate": 'Signature error="webhook_signature_replayed"'})
    assert classify(401, headers).reason == "signature_rejected"


def test_httpx_headers_if_available():
    httpx = pytest.importorskip("httpx")
    headers = httpx.Headers(
        [("www-authenticate", 'Bearer realm="x"'), ("WWW-Authenticate", 'Signature error="webhook_signature_invalid"')]
    )
    verdict = classify(401, headers)
    assert verdict.reason == "signature_rejected"
    assert verdict.detail == "HTTP 401 webhook_signature_invalid"


# --------------------------------------------------------------------------- transport errors


@pytest.mark.parametrize(
    ("kind", "action", "reason", "outcome"),
    [
        ("timeout", "retry", None, "timeout"),
        ("connection_error", "retry", None, "connection_error"),
        ("protocol_error", "retry", None, "connection_error"),
        ("blocked", "dead", "blocked", "connection_error"),
        ("something_new", "retry", None, "connection_error"),
    ],
)
def test_transport_errors(kind, action, reason, outcome):
    verdict = classify_transport_error(kind)
    assert (verdict.action, verdict.reason, verdict.outcome, verdict.retry_after) == (action, reason, outcome, None)
    assert verdict.detail


# --------------------------------------------------------------------------- parse_retry_after examples


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        ("   ", None),
        ("0", 0.0),
        ("120", 120.0),
        (" 120 ", 120.0),
        ("\t7", 7.0),
        ("000030", 30.0),
        ("600", 600.0),
        ("601", 600.0),
        ("9" * 20, 600.0),
        ("9" * 5000, 600.0),  # larger than int()'s default digit limit: still no raise
        ("-5", None),
        ("1.5", None),
        ("+5", None),
        ("1e3", None),
        ("١٢", None),  # Arabic-Indic digits are not DIGIT
        ("²", None),
        ("12 34", None),
        ("soon", None),
        ("Mon", None),
        ("1 2 3", None),
        ("Sun, 06 Nov 1994 08:49:37 GMT", 0.0),  # past
        ("Sunday, 06-Nov-94 08:49:37 GMT", 0.0),  # RFC 850, past
        ("Sun Nov  6 08:49:37 1994", 0.0),  # asctime, past
        ("Tue, 14 Nov 2023 22:14:20 GMT", 60.0),  # NOW + 60
        ("Tuesday, 14-Nov-23 22:14:20 GMT", 60.0),
        ("Tue Nov 14 22:14:20 2023", 60.0),
        ("tue, 14 nov 2023 22:14:20 gmt", 60.0),
        ("Tue, 14 Nov 2023 22:13:20 GMT", 0.0),  # exactly now
        ("Tue, 14 Nov 2024 22:13:20 GMT", 600.0),  # far future, capped
        ("Fri, 31 Dec 9999 23:59:59 GMT", 600.0),
        ("Tue, 31 Feb 2023 22:14:20 GMT", None),  # impossible date
        ("Tue, 14 Nov 2023 25:14:20 GMT", None),
        ("Tue, 14 Nov 2023 22:14:20 +0000", None),  # not an HTTP-date
        ("Tue, 14 Nov 2023 22:14:20", None),
    ],
)
def test_parse_retry_after_examples(value, expected):
    result = parse_retry_after(value, now=NOW, cap=CAP)
    if expected is None:
        assert result is None
    else:
        assert result == pytest.approx(expected)


def test_parse_retry_after_negative_cap_is_zero():
    assert parse_retry_after("30", now=NOW, cap=-1.0) == 0.0


@settings(max_examples=500)
@given(value=st.text(), now=st.floats(0, 4e9), cap=st.floats(0, 1e7))
def test_parse_retry_after_never_raises_and_stays_in_range(value, now, cap):
    result = parse_retry_after(value, now=now, cap=cap)
    assert result is None or 0.0 <= result <= cap


_http_date_text = st.one_of(
    st.text(alphabet="0123456789 ,:-GMTSunMonNovDec\t", max_size=40),
    st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31)).map(
        lambda d: d.strftime("%a, %d %b %Y %H:%M:%S GMT")
    ),
    st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31)).map(
        lambda d: d.strftime("%A, %d-%b-%y %H:%M:%S GMT")
    ),
    st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31)).map(
        lambda d: d.strftime("%a %b %e %H:%M:%S %Y")
    ),
)


@settings(max_examples=300)
@given(value=_http_date_text, now=st.floats(-1e12, 1e12), cap=st.floats(0, 1e9))
def test_parse_retry_after_date_like_text_never_raises(value, now, cap):
    result = parse_retry_after(value, now=now, cap=cap)
    assert result is None or 0.0 <= result <= cap


@given(seconds=st.integers(0, 10**30), cap=st.floats(0, 1e7))
def test_parse_retry_after_delta_seconds(seconds, cap):
    assert parse_retry_after(str(seconds), now=NOW, cap=cap) == min(float(seconds), cap)


@given(offset=st.integers(-10**6, 10**6))
def test_parse_retry_after_imf_fixdate_round_trip(offset):
    when = datetime.fromtimestamp(NOW + offset, tz=timezone.utc)
    value = format_datetime(when, usegmt=True)
    assert parse_retry_after(value, now=NOW, cap=1e7) == pytest.approx(max(offset, 0), abs=1e-6)


# --------------------------------------------------------------------------- signature_error_code


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("", None),
        ('Signature error="webhook_signature_invalid"', "webhook_signature_invalid"),
        ("Signature error=webhook_signature_invalid", "webhook_signature_invalid"),
        ('signature ERROR="webhook_signature_replayed"', "webhook_signature_replayed"),
        ('SIGNATURE   error  =  "webhook_signature_window_invalid"  ', "webhook_signature_window_invalid"),
        ('Bearer realm="x", Signature error="webhook_signature_invalid"', "webhook_signature_invalid"),
        ('Signature realm="adcp", error="webhook_body_malformed"', "webhook_body_malformed"),
        ('Basic realm="a, b", Signature alg="ed25519", error="webhook_mode_mismatch", x=y', "webhook_mode_mismatch"),
        ("Negotiate abc+/==, Signature error=webhook_target_uri_malformed", "webhook_target_uri_malformed"),
        ('Signature error="webhook_\\"quoted\\""', "webhook__quoted_"),
        ('Signature error="WEBHOOK_SIGNATURE_KEY_REVOKED"', "webhook_signature_key_revoked"),
        ('Signature error="webhook_x\r\nSet-Cookie: a=b"', "webhook_x__set_cookie__a_b"),
        ('Signature error="invalid_signature"', None),
        ('Signature error=""', None),
        ("Signature error=", None),
        ('Bearer error="webhook_signature_invalid"', None),
        ('Bearer realm="Signature error=webhook_signature_invalid"', None),
        ('Signature realm="x"', None),
        ("Signature", None),
        ('Signature error="webhook_unterminated', "webhook_unterminated"),
        ('Signature error="invalid", Signature error="webhook_second"', "webhook_second"),
        ('==,,"" = Signature error = webhook_ok', "webhook_ok"),
    ],
)
def test_signature_error_code_examples(header, expected):
    assert signature_error_code(header) == expected


def test_signature_error_code_is_bounded():
    assert len(signature_error_code('Signature error="webhook_' + "a" * 10_000 + '"')) == 80


@settings(max_examples=1000)
@given(st.text())
def test_signature_error_code_never_raises(text):
    code = signature_error_code(text)
    assert code is None or (code.startswith("webhook_") and len(code) <= 80)


@settings(max_examples=500)
@given(st.text(alphabet=' \t,="\\=SignatureErrorwebhook_BearerBasic', max_size=80))
def test_signature_error_code_never_raises_on_header_like_noise(text):
    code = signature_error_code(text)
    assert code is None or code.startswith("webhook_")


_token = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~", min_size=1, max_size=12)
_ows = st.text(alphabet=" \t", max_size=3)
_quotable = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20
).map(lambda s: '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"')
_other_scheme = _token.filter(lambda t: t.lower() != "signature")
_other_param_name = _token.filter(lambda t: t.lower() != "error")


@st.composite
def _auth_param(draw, name=_other_param_name):
    return f"{draw(name)}{draw(_ows)}={draw(_ows)}{draw(st.one_of(_token, _quotable))}"


@st.composite
def _other_challenge(draw):
    scheme = draw(_other_scheme)
    params = draw(st.lists(_auth_param(), max_size=3))
    if not params:
        return scheme
    return scheme + " " + ", ".join(params)


@st.composite
def _signature_challenge_header(draw):
    code = "webhook_" + draw(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", max_size=30))
    scheme = draw(st.sampled_from(["Signature", "signature", "SIGNATURE", "SiGnAtUrE"]))
    name = draw(st.sampled_from(["error", "Error", "ERROR"]))
    value = draw(st.sampled_from([code, f'"{code}"']))
    error_param = f"{name}{draw(_ows)}={draw(_ows)}{value}"
    params = draw(st.lists(_auth_param(), max_size=3))
    params.insert(draw(st.integers(0, len(params))), error_param)
    challenge = scheme + draw(st.sampled_from([" ", "  ", " \t"])) + ", ".join(params)
    before = draw(st.lists(_other_challenge(), max_size=2))
    after = draw(st.lists(_other_challenge(), max_size=2))
    separator = draw(st.sampled_from([", ", ",", " , ", ",  "]))
    return separator.join([*before, challenge, *after]), code


@settings(max_examples=500)
@given(_signature_challenge_header())
def test_signature_error_code_round_trips_generated_challenges(header_and_code):
    header, code = header_and_code
    assert signature_error_code(header) == code


@settings(max_examples=300)
@given(st.lists(_other_challenge(), min_size=1, max_size=4))
def test_signature_error_code_none_without_signature_challenge(challenges):
    assert signature_error_code(", ".join(challenges)) is None


# --------------------------------------------------------------------------- RetryPolicy


def test_retry_policy_defaults():
    policy = RetryPolicy()
    assert (policy.base_delay_seconds, policy.max_delay_seconds, policy.jitter) == (2.0, 3600.0, True)


def test_retry_policy_schedule_without_jitter():
    policy = RetryPolicy(jitter=False)
    assert [policy.delay_for_attempt(n) for n in range(1, 14)] == [
        2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 3600.0, 3600.0,
    ]
    assert policy.delay_for_attempt(0) == policy.delay_for_attempt(-3) == 2.0
    assert policy.delay_for_attempt(10**9) == 3600.0


def test_retry_policy_meets_adcp_conformance_window():
    """protocol.md "Retry horizon": 503 three times then 200, >= 2 deliveries within 90 s — with the worst jitter."""

    class Max(random.Random):
        def random(self):
            return 0.9999999999

    policy = RetryPolicy()
    elapsed = sum(policy.delay_for_attempt(n, Max()) for n in (1, 2, 3))
    assert policy.delay_for_attempt(1, Max()) < 90
    assert elapsed < 90  # even the 4th (successful) delivery lands inside the window


def test_retry_policy_rejects_nonsense():
    with pytest.raises(ValueError):
        RetryPolicy(base_delay_seconds=-1)
    with pytest.raises(ValueError):
        RetryPolicy(base_delay_seconds=10, max_delay_seconds=5)
    with pytest.raises(ValueError):
        RetryPolicy(max_delay_seconds=float("inf"))


def test_retry_policy_uses_global_random_without_rng():
    policy = RetryPolicy()
    for _ in range(200):
        assert 2.0 <= policy.delay_for_attempt(1) <= 2.5


_policies = st.builds(
    lambda base, factor, jitter: RetryPolicy(base_delay_seconds=base, max_delay_seconds=base * factor, jitter=jitter),
    st.floats(0.001, 600),
    st.floats(1, 10_000),
    st.booleans(),
)


@settings(max_examples=300)
@given(policy=_policies, seed=st.integers(0, 2**32), attempts=st.integers(1, 80))
def test_retry_policy_within_a_quarter_above_the_capped_schedule(policy, seed, attempts):
    rng = random.Random(seed)
    for n in range(1, attempts + 1):
        scheduled = min(policy.base_delay_seconds * 2 ** (n - 1), policy.max_delay_seconds)
        d = policy.delay_for_attempt(n, rng)
        assert scheduled * (1 - 1e-12) <= d <= scheduled * (1.25 if policy.jitter else 1) * (1 + 1e-12)


@settings(max_examples=300)
@given(policy=_policies, seed=st.integers(0, 2**32))
def test_retry_policy_first_delay_window(policy, seed):
    first = policy.delay_for_attempt(1, random.Random(seed))
    base = policy.base_delay_seconds
    assert base <= first <= 1.25 * base * (1 + 1e-12)


def test_retry_policy_jitter_survives_the_cap():
    """Messages at the cap must not retry in lockstep (the jitter used to be capped away)."""
    policy = RetryPolicy()
    capped = {policy.delay_for_attempt(30) for _ in range(50)}
    assert len(capped) > 40 and min(capped) >= 3600.0 and max(capped) <= 4500.0


@given(policy=_policies, seed=st.integers(0, 2**32), attempts=st.integers(-10, 10**6))
def test_retry_policy_never_exceeds_the_jittered_cap(policy, seed, attempts):
    delay = policy.delay_for_attempt(attempts, random.Random(seed))
    assert 0 <= delay <= 1.25 * policy.max_delay_seconds * (1 + 1e-12)
