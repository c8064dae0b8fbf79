"""Confirmations that act once: the token a confirmation form carries is spent by its first
post, so a double click, a reload or the back button cannot replay a message twice (a
delivered message may be replayed, so a second replay would send it again).

The first post acts and keeps its outcome under the token; the page it redirects to reads
the outcome from there (post, redirect, get), and any later post of the same form is shown
that outcome instead of acting. In memory, like the sessions (:mod:`supervisor.ui.auth`):
one console process.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

KEPT = 1000  # confirmations remembered, issued or spent; the oldest are forgotten first


class _Acting:
    """The outcome of a confirmation whose first post is still acting."""


ACTING = _Acting()


@dataclass
class Confirmations:
    _tokens: OrderedDict[str, Any] = field(default_factory=OrderedDict)  # token -> None (unspent) or outcome

    def issue(self) -> str:
        """A fresh token for one confirmation form."""
        token = secrets.token_urlsafe(18)
        self._tokens[token] = None
        while len(self._tokens) > KEPT:
            self._tokens.popitem(last=False)
        return token

    def spend(self, token: str) -> tuple[bool, Any]:
        """``(True, None)`` the first time ``token`` is posted (the caller acts, then calls
        :meth:`settle`); ``(False, outcome)`` after that (:data:`ACTING` while the first post
        still acts); ``(False, None)`` for a token never issued or forgotten."""
        if token not in self._tokens:
            return False, None
        outcome = self._tokens[token]
        if outcome is not None:
            return False, outcome
        self._tokens[token] = ACTING
        return True, None

    def settle(self, token: str, outcome: Any) -> None:
        self._tokens[token] = outcome

    def outcome(self, token: str) -> Any:
        """What the confirmation ``token`` did (``None``: unknown or not yet posted)."""
        return self._tokens.get(token)
