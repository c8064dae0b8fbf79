"""Who may use the console: a sign-in token, a session cookie, and a CSRF token per session.

Any page needs a session (the console shows tenants and URLs); any action (a POST) also
needs the session's CSRF token in the form, so another site cannot make a signed-in
browser replay or reset anything. The cookie is ``HttpOnly`` and ``SameSite=Strict``.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass, field

COOKIE = "outboxd_session"
MAX_SESSIONS = 1000


@dataclass
class Sessions:
    """The console's sign-in token and its live sessions (in memory: one process)."""

    token: str
    _csrf_by_session: dict[str, str] = field(default_factory=dict)

    def sign_in(self, offered: str) -> str | None:
        """A new session id when ``offered`` is the token, else ``None``."""
        if not hmac.compare_digest(offered.encode(), self.token.encode()):
            return None
        if len(self._csrf_by_session) >= MAX_SESSIONS:  # bounded: drop the oldest
            self._csrf_by_session.pop(next(iter(self._csrf_by_session)))
        session = secrets.token_urlsafe(32)
        self._csrf_by_session[session] = secrets.token_urlsafe(32)
        return session

    def csrf(self, session: str | None) -> str | None:
        """The CSRF token of a live session, ``None`` for no or an unknown session."""
        return self._csrf_by_session.get(session or "")

    def csrf_ok(self, session: str | None, offered: str | None) -> bool:
        expected = self.csrf(session)
        return expected is not None and offered is not None and hmac.compare_digest(expected, offered)

    def sign_out(self, session: str | None) -> None:
        self._csrf_by_session.pop(session or "", None)
