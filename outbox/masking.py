"""Masking of credentials for display, in structured payloads and in a receiver's free text.

One vocabulary of secret names (:func:`is_secret_key`) serves both: a payload key named
``token`` and a line ``token=...`` in an error page are masked alike. A receiver's response
body is hostile text; :func:`response_excerpt` turns at most a few hundred of its bytes into one
short printable line for the attempt row, masked before it is stored (docs/protocol.md
"Attempt records").
"""

from __future__ import annotations

import re

from outbox.activity import secret_looking
from outbox.urls import redact_urls

# Keys whose values are credentials wherever they appear in a payload: the buyer's
# push-notification token, an authentication object, credentials (docs/protocol.md).
SECRET_KEYS = frozenset({"token", "authentication", "credentials", "authorization", "secret", "password",
                         "api_key"})
REDACTED = "[redacted]"
EXCERPT_CHARS = 200  # what an attempt row keeps of a failed answer's body, at most

# C0 and C1 controls, DEL, line and paragraph separators, and the bidirectional overrides
# that would make a terminal or a page show the text in another order than stored.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]+")
_SPACES = re.compile(r"\s{2,}")
# An authorization scheme and its credential (RFC 9110 section 11.4): ``Bearer abc...``.
_SCHEME = re.compile(r"\b(bearer|basic|digest)(\s+)[^\s\"',;<>]+", re.IGNORECASE)
# ``name=value``, ``name: value``, ``"name": "value"`` (JSON, headers, query strings, forms).
_PAIR = re.compile(r"([A-Za-z][\w-]*)(\"?\s*[:=]\s*\"?)([^\s\"',;&<>]+)")
_WORD = re.compile(r"[A-Za-z0-9_\-.~+=]{16,}")


def is_secret_key(name: str) -> bool:
    """Whether a payload key or column name holds a credential (``token``, ``auth_secret``, ...)."""
    lowered = name.lower().replace("-", "_")
    return lowered in SECRET_KEYS or lowered.endswith(("_secret", "_token", "_password", "_credentials"))


def mask_text(text: str) -> str:
    """``text`` with credentials masked: URLs reduced to their public form, an authorization
    scheme's credential, the value of any secret-named field, and any word that looks like
    random key material (a UUID, a long mix of letters and digits)."""
    text = redact_urls(text)
    text = _SCHEME.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    text = _PAIR.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}" if is_secret_key(m.group(1)) else m.group(0),
                     text)
    return _WORD.sub(lambda m: REDACTED if secret_looking(m.group(0)) else m.group(0), text)


def response_excerpt(body: bytes, *, cut: bool) -> str | None:
    """One printable, masked line of at most :data:`EXCERPT_CHARS` characters from the start
    of a failed answer's body (``None`` for an empty one).

    ``cut``: the body was cut short where it was read, so its last word is partial and is
    dropped (a credential cut in two is not recognisable, so none of it is kept).
    """
    text = _SPACES.sub(" ", _UNPRINTABLE.sub(" ", body.decode("utf-8", "replace"))).strip()
    if cut and " " in text:
        text = text.rsplit(" ", 1)[0] + " …"
    elif cut:
        text = ""
    text = mask_text(text)[:EXCERPT_CHARS].rstrip()
    return text or None
