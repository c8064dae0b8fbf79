"""What a group of console pages needs from the app: rendering, the session checks and the
database, so pages kept in their own module share the app's sign-in and CSRF rules."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response

from supervisor.ui.once import Confirmations


@dataclass(frozen=True)
class Kit:
    render: Callable[..., Response]  # (request, template, status_code=200, **context)
    action_form: Callable[[Request], Awaitable[FormData | Response]]  # the form, or the refusal (401/403)
    signed_in: Callable[[Request], bool]
    engine: Callable[[], AsyncEngine]  # for actions (they write)
    reader: Callable[[], AsyncEngine]  # for pages: the same pool, transactions that only read (outbox.db.reading)
    confirmations: Confirmations  # one-time tokens: a confirmation acts once (supervisor/ui/once.py)

    def refuse(self, request: Request, status: int, message: str) -> Response:
        """The error page with a fixed sentence."""
        return self.render(request, "error.html", status, message=message)
