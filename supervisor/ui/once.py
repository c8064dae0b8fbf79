"""Confirmations that act once: the token a confirmation form carries is spent by its first
post, so a double click, a reload or the back button cannot replay a message twice (a
delivered message may be replayed, so a second replay would send it again) or start a second
recovery job.

The first post acts and keeps its outcome under the token; the page it redirects to reads
the outcome from there (post, redirect, get), and any later post of the same form, even one
arriving while the first still acts, waits for and is shown that outcome instead of acting.
An act that fails before it changed anything (it raises) leaves the token unspent, so the
same confirmation may be posted again; one that changes things in steps must return what it
did, failure included (:class:`supervisor.operator.replay.ReplayResult` does). In memory, like
the sessions (:mod:`supervisor.ui.auth`): one console process.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

KEPT = 1000  # confirmations remembered, issued or spent; the oldest are forgotten first


@dataclass
class Confirmations:
    # token -> None (unspent), or the first post's outcome (a future while it acts)
    _tokens: OrderedDict[str, asyncio.Future[Any] | None] = field(default_factory=OrderedDict)

    def issue(self) -> str:
        """A fresh token for one confirmation form."""
        token = secrets.token_urlsafe(18)
        self._tokens[token] = None
        while len(self._tokens) > KEPT:
            self._tokens.popitem(last=False)
        return token

    def known(self, token: str) -> bool:
        """Whether ``token`` was issued here and is not forgotten."""
        return token in self._tokens

    async def act_once(self, token: str, act: Callable[[], Awaitable[Any]]) -> Any:
        """``act()``'s outcome for the first post of a :meth:`known` ``token``, and that same
        outcome for every later post (waiting for it while the first still acts)."""
        outcome = self._tokens[token]
        if outcome is not None:
            return await asyncio.shield(outcome)
        outcome = self._tokens[token] = asyncio.get_running_loop().create_future()
        try:
            outcome.set_result(await act())
        except BaseException as exc:
            self._tokens[token] = None  # nothing done: the confirmation may be posted again
            outcome.set_exception(exc)
            outcome.exception()  # retrieved: a failure no other post waited for is not "never retrieved"
            raise
        return outcome.result()

    def outcome(self, token: str) -> Any:
        """What the confirmation ``token`` did (``None``: unknown, not posted, or still acting)."""
        outcome = self._tokens.get(token)
        return outcome.result() if outcome is not None and outcome.done() and not outcome.exception() else None
