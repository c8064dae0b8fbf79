"""Who may use the console: a sign-in token, a session cookie, and a CSRF token per session.

Any page needs a session (the console shows tenants and URLs); any action (a POST) also
needs the session's CSRF token in the form, so another site cannot make a signed-in
browser replay or reset anything. The cookie is ``HttpOnly`` and ``SameSite=Strict``. A
session ends at sign-out or :data:`SESSION_SECONDS` after sign-in, so a cookie copied off a
machine stops working within a working day even if nobody signs out.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

COOKIE = "outboxd_session"
MAX_SESSIONS = 1000
SESSION_SECONDS = 12 * 3600


@dataclass
class Sessions:
    """The console's sign-in token and its live sessions (in memory: one process)."""

    token: str
    clock: Callable[[], float] = time.monotonic
    _csrf_by_session: dict[str, tuple[str, float]] = field(default_factory=dict)  # (csrf, ends at)

    def sign_in(self, offered: str) -> str | None:
        """A new session id when ``offered`` is the token, else ``None``."""
        if not hmac.compare_digest(offered.encode(), self.token.encode()):
            return None
        if len(self._csrf_by_session) >= MAX_SESSIONS:  # bounded: drop the oldest
            self._csrf_by_session.pop(next(iter(self._csrf_by_session)))
        session = secrets.token_urlsafe(32)
        self._csrf_by_session[session] = (secrets.token_urlsafe(32), self.clock() + SESSION_SECONDS)
        return session

    def csrf(self, session: str | None) -> str | None:
        """The CSRF token of a live session, ``None`` for no, an unknown or an ended session."""
        csrf, ends_at = self._csrf_by_session.get(session or "", (None, 0.0))
        if csrf is not None and self.clock() >= ends_at:
            self.sign_out(session)
            return None
        return csrf

    def csrf_ok(self, session: str | None, offered: str | None) -> bool:
        expected = self.csrf(session)
        return expected is not None and offered is not None and hmac.compare_digest(expected, offered)

    def sign_out(self, session: str | None) -> None:
        self._csrf_by_session.pop(session or "", None)
