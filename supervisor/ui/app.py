"""The console's pages and its two actions, replay and breaker reset.

Every read goes through :mod:`supervisor.ops` and every replay through
:func:`supervisor.replay.replay`, the code ``outboxd replay`` runs, so the console can
neither show a secret the CLI hides nor replay what the CLI would refuse.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, MetaData, Table, inspect, select
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route
from starlette.templating import Jinja2Templates

from outbox.config import Settings
from outbox.db import make_async_engine
from outbox.schema import DEAD_REASONS, STATES
from supervisor import ops
from supervisor.cli_common import parse_time
from supervisor.replay import replay
from supervisor.ui.auth import COOKIE, Sessions

TEMPLATES = Jinja2Templates(directory=str(Path(__file__).with_name("templates")))
FILTER_FIELDS = ("tenant", "key", "url", "state", "reason", "since", "until")
SUBSCRIBERS_TABLE = "outbox_subscribers"  # added by a later migration; shown when present
PAGE_LIMIT = 200
SECURITY_HEADERS = {"X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store",
                    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'"}


class BadFilter(ValueError):
    """A search field the user can fix (shown on the page)."""


def filters_from(params: Any, limit: int = PAGE_LIMIT) -> ops.Filters:
    """:class:`ops.Filters` from a query string or form; empty fields are no filter."""
    values = {f: (params.get(f) or "").strip() or None for f in FILTER_FIELDS}
    if values["state"] and values["state"] not in STATES:
        raise BadFilter(f"state must be one of {', '.join(STATES)}")
    if values["reason"] and values["reason"] not in DEAD_REASONS:
        raise BadFilter(f"reason must be one of {', '.join(DEAD_REASONS)}")
    times = {}
    for name in ("since", "until"):
        try:
            times[name] = parse_time(values[name]) if values[name] else None
        except argparse.ArgumentTypeError as exc:
            raise BadFilter(f"{name}: {exc}") from None
    return ops.Filters(state=values["state"], reason=values["reason"], tenant=values["tenant"], key=values["key"],
                       url=values["url"], since=times["since"], until=times["until"], limit=limit)


def _reflect(conn: Connection, name: str) -> Table | None:
    return Table(name, MetaData(), autoload_with=conn) if inspect(conn).has_table(name) else None


async def subscribers(engine: AsyncEngine) -> list[dict[str, Any]] | None:
    """The subscriber registry's rows, masked like a payload; ``None`` when the table does not exist."""
    async with engine.connect() as conn:
        table = await conn.run_sync(_reflect, SUBSCRIBERS_TABLE)
        if table is None:
            return None
        rows = (await conn.execute(select(table).limit(PAGE_LIMIT))).mappings().all()
    return [ops.redact({k: (v.hex() if isinstance(v, bytes) else v) for k, v in r.items()}) for r in rows]


def make_app(settings: Settings, token: str) -> Starlette:
    """The console as an ASGI app, signed in with ``token``."""
    sessions = Sessions(token)
    state: dict[str, AsyncEngine] = {}

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state["engine"] = make_async_engine(settings.database_url)
        yield
        await state["engine"].dispose()

    def render(request: Request, name: str, status_code: int = 200, **context: Any) -> Response:
        session = request.cookies.get(COOKIE)
        response = TEMPLATES.TemplateResponse(request, name, {"csrf": sessions.csrf(session), **context},
                                              status_code=status_code)
        response.headers.update(SECURITY_HEADERS)
        return response

    def signed_in(request: Request) -> bool:
        return sessions.csrf(request.cookies.get(COOKIE)) is not None

    async def action_form(request: Request) -> FormData | Response:
        """The form of an allowed action, or the refusal: 401 without a session, 403 on a bad CSRF token."""
        form = await request.form()
        if not signed_in(request):
            return render(request, "error.html", 401, message="sign in first: actions need the console token")
        csrf = form.get("csrf")
        if not sessions.csrf_ok(request.cookies.get(COOKIE), csrf if isinstance(csrf, str) else None):
            return render(request, "error.html", 403, message="CSRF token missing or wrong: reload the page")
        return form

    async def login(request: Request) -> Response:
        if request.method == "GET":
            return render(request, "login.html")
        offered = (await request.form()).get("token")
        session = sessions.sign_in(offered if isinstance(offered, str) else "")
        if session is None:
            return render(request, "login.html", 401, error="wrong token")
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(COOKIE, session, httponly=True, samesite="strict", path="/")
        return response

    async def overview(request: Request) -> Response:
        if not signed_in(request):
            return RedirectResponse("/login", status_code=303)
        async with state["engine"].connect() as conn:
            status = await ops.status(conn, top=20)
            breakers = await ops.list_breakers(conn)
        return render(request, "overview.html", status=status, breakers=breakers,
                      subscribers=await subscribers(state["engine"]), notice=request.query_params.get("notice"))

    async def messages(request: Request) -> Response:
        if not signed_in(request):
            return RedirectResponse("/login", status_code=303)
        params = {f: request.query_params.get(f, "") for f in FILTER_FIELDS}
        try:
            filters = filters_from(request.query_params)
        except BadFilter as exc:
            return render(request, "messages.html", 400, params=params, rows=[], more=0, error=str(exc),
                          states=STATES, reasons=DEAD_REASONS)
        async with state["engine"].connect() as conn:
            rows = await ops.list_messages(conn, filters)
            more = await ops.count_matching(conn, filters) - len(rows)
        return render(request, "messages.html", params=params, rows=rows, more=more, states=STATES,
                      reasons=DEAD_REASONS, searched=any(params.values()))

    async def message(request: Request) -> Response:
        if not signed_in(request):
            return RedirectResponse("/login", status_code=303)
        async with state["engine"].connect() as conn:
            data = await ops.show(conn, request.path_params["ref"], settings.sealing())
        if data is None:
            return render(request, "error.html", 404, message="no such message")
        payload = json.dumps(data.pop("payload"), indent=2, sort_keys=True)
        return render(request, "message.html", m=data, payload=payload)

    async def replay_action(request: Request) -> Response:
        form = await action_form(request)
        if isinstance(form, Response):
            return form
        ids = [int(i) for i in form.getlist("id") if isinstance(i, str) and i.isdigit()]
        try:
            filters = None if ids else filters_from(form, limit=int(str(form.get("limit") or 1000)))
        except (BadFilter, ValueError) as exc:
            return render(request, "error.html", 400, message=str(exc))
        if filters is not None and not any(form.get(f) for f in FILTER_FIELDS):
            return render(request, "error.html", 400, message="a filtered replay needs at least one filter")
        confirmed = form.get("confirm") == "yes"
        result = await replay(state["engine"], ids=ids, filters=filters, force=False, dry_run=not confirmed,
                              horizon_seconds=settings.retry_horizon_seconds)
        return render(request, "replay.html", result=result)  # the confirmation names the dry run's ids

    async def reset_breaker(request: Request) -> Response:
        form = await action_form(request)
        if isinstance(form, Response):
            return form
        tenant, origin = str(form.get("tenant") or ""), str(form.get("origin") or "")
        async with state["engine"].begin() as conn:
            found = await ops.reset_breaker(conn, tenant, origin)
        notice = f"breaker {tenant}@{origin} reset" if found else f"no breaker {tenant}@{origin}"
        return RedirectResponse(f"/?notice={notice}", status_code=303)

    async def logout(request: Request) -> Response:
        form = await action_form(request)
        if isinstance(form, Response):
            return form
        sessions.sign_out(request.cookies.get(COOKIE))
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(COOKIE, path="/")
        return response

    return Starlette(lifespan=lifespan, routes=[
        Route("/login", login, methods=["GET", "POST"]),
        Route("/", overview),
        Route("/messages", messages),
        Route("/messages/{ref}", message),
        Route("/replay", replay_action, methods=["POST"]),
        Route("/breakers/reset", reset_breaker, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
    ])
