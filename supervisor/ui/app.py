"""The console's pages and its actions, replay and breaker reset (recovery jobs: :mod:`supervisor.ui.recovery`).

Every read goes through :mod:`supervisor.operator.ops` or :mod:`supervisor.ui.queries` (which mask
like ``outboxd show``) and every replay through :func:`supervisor.operator.replay.replay`, the code
``outboxd replay`` runs, so the console can neither show a secret the CLI hides nor replay
what the CLI would refuse.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from sqlalchemy.exc import DataError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.middleware import Middleware
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from outbox import store
from outbox.config import Settings
from outbox.db import error_line, make_async_engine, reading
from outbox.schema import DEAD_REASONS, STATES
from supervisor.cycle.cutoff import bound_each_hold
from supervisor.cycle.operator_engine import operator_engine
from supervisor.observe import health_stats
from supervisor.operator import ops
from supervisor.operator.replay import ReplayResult, replay
from supervisor.ui import charts, present, queries, recovery
from supervisor.ui.auth import COOKIE, Sessions
from supervisor.ui.headers import SecurityHeaders
from supervisor.ui.forms import (FILTER_FIELDS, HEALTH_WINDOWS, BadInput, filters_from, health_window, page_start,
                                 replay_limit)
from supervisor.ui.kit import Kit
from supervisor.ui.once import Confirmations
from supervisor.ui.registry import subscribers
from supervisor.ui.timeseries import DAY, HOUR, Scope, series

HERE = Path(__file__).parent
TEMPLATES = Jinja2Templates(directory=str(HERE / "templates"))
present.install(TEMPLATES.env)
PAGE_SIZE = 50
ENDPOINTS_SHOWN = 25
FAILURES_SHOWN = 20
REFRESH_SECONDS = 15
# The only banners a redirect can ask for: a query string never puts its own words on the page.
NOTICES = {
    "breaker-reset": "Breaker reset: the endpoint takes deliveries again at once.",
    "breaker-missing": "There was no breaker to reset: it had closed or been reset already.",
    **recovery.NOTICES,
}


def here(request: Request, **changes: Any) -> str:
    """This page's path and query with ``changes`` (``None`` removes a parameter): relative,
    so links stay right behind a TLS-terminating proxy."""
    params = {k: v for k, v in request.query_params.items() if k not in changes}
    params.update({k: v for k, v in changes.items() if v is not None})
    return request.url.path + (f"?{urlencode(params)}" if params else "")


async def charts_for(conn: AsyncConnection, scope: Scope, now: float) -> dict[str, Any]:
    """The hour's and the day's charts of a scope, with their totals."""
    drawn: dict[str, Any] = {}
    for window in (HOUR, DAY):
        data = await series(conn, window, scope, now)
        drawn[window.name] = {"series": data, "throughput": charts.throughput(data), "latency": charts.latency(data)}
    return drawn


async def endpoint_health(conn: AsyncConnection, scope: Scope, endpoints: list[dict[str, Any]]
                          ) -> list[health_stats.EndpointHealth | None]:
    """The last hour's health of each listed endpoint (``None``: no attempt in the hour),
    from the hour's per-minute rollup rows: never from the attempt history."""
    keys = [(e["tenant_id"], e["origin"]) for e in endpoints]
    found = {(h.tenant_id, h.origin): h for h in await health_stats.endpoint_health(
        conn, window_seconds=HOUR.seconds, tenant=scope.tenant, endpoints=keys)}
    return [found.get((e["tenant_id"], e["origin"])) for e in endpoints]


def make_app(settings: Settings, token: str) -> Starlette:
    """The console as an ASGI app, signed in with ``token``."""
    sessions = Sessions(token)
    confirmations = Confirmations()  # replays and recovery jobs: each confirmation acts once
    state: dict[str, AsyncEngine] = {}

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state["engine"] = operator_engine(settings, make_async_engine)
        state["reader"] = reading(state["engine"])  # the pages: on SQLite they never take the write lock
        bound_each_hold(state["engine"], settings.database_statement_timeout_seconds)
        yield
        await state["engine"].dispose()

    def render(request: Request, name: str, status_code: int = 200, **context: Any) -> Response:
        session = request.cookies.get(COOKIE)
        refreshing = context.pop("refreshes", False) and request.query_params.get("refresh") != "off"
        return TEMPLATES.TemplateResponse(request, name, {
            "csrf": sessions.csrf(session), "refresh_seconds": REFRESH_SECONDS if refreshing else None,
            "pause_url": here(request, refresh="off"), "resume_url": here(request, refresh=None),
            "notice": NOTICES.get(request.query_params.get("notice", "")), **context}, status_code=status_code)

    async def unstorable_value(request: Request, exc: Exception) -> Response:
        """A value the database refuses to compare (a NUL, a number past its range): the
        request's fault, 400, not an outage."""
        return render(request, "error.html", 400,
                      message=f"A value in the request cannot be looked up ({error_line(exc)}).")

    async def database_unavailable(request: Request, exc: Exception) -> Response:
        """A page the database could not serve: 503 and why, not a bare 500."""
        return render(request, "error.html", 503, title="Database unavailable",
                      message=f"The outbox database did not answer ({error_line(exc)}). Reload once it is back.")

    def signed_in(request: Request) -> bool:
        return sessions.csrf(request.cookies.get(COOKIE)) is not None

    async def action_form(request: Request) -> FormData | Response:
        """The form of an allowed action, or the refusal: 401 without a session (its body left
        unread, so no one without the token makes the console parse anything), 403 on a bad CSRF
        token."""
        if not signed_in(request):
            return render(request, "error.html", 401, message="Sign in first: actions need the console token.")
        form = await request.form()
        csrf = form.get("csrf")
        if not sessions.csrf_ok(request.cookies.get(COOKIE), csrf if isinstance(csrf, str) else None):
            return render(request, "error.html", 403, message="The form's security token is missing or stale: "
                                                              "reload the page and try again.")
        return form

    async def login(request: Request) -> Response:
        if request.method == "GET":
            return render(request, "login.html")
        offered = (await request.form()).get("token")
        session = sessions.sign_in(offered if isinstance(offered, str) else "")
        if session is None:
            return render(request, "login.html", 401, error="That is not the console token.")
        response = RedirectResponse("/", status_code=303)
        # Secure whenever the browser reached the console over TLS (directly or, with the proxy's
        # X-Forwarded-Proto, through it), so the cookie never travels back over plain HTTP.
        response.set_cookie(COOKIE, session, httponly=True, samesite="strict", path="/",
                            secure=request.url.scheme == "https")
        return response

    async def overview(request: Request) -> Response:
        if not signed_in(request):
            return RedirectResponse("/login", status_code=303)
        scope = Scope(tenant=request.query_params.get("tenant") or None)
        async with state["reader"].connect() as conn:
            health = await queries.health(conn, scope)
            status = await ops.status(conn, top=20)
            endpoints, more_endpoints = await queries.endpoints(conn, scope, ENDPOINTS_SHOWN)
            for shown, found in zip(endpoints, await endpoint_health(conn, scope, endpoints)):
                shown["health"] = found
            drawn = await charts_for(conn, scope, health.now)
            counts = await queries.state_counts(conn, scope) if scope.tenant else status["messages"]
        return render(request, "overview.html", refreshes=True, scope=scope, health=health, status=status,
                      counts=counts, endpoints=endpoints, more_endpoints=more_endpoints, charts=drawn,
                      now=health.now, subscribers=await subscribers(state["reader"]))

    async def endpoint(request: Request) -> Response:
        if not signed_in(request):
            return RedirectResponse("/login", status_code=303)
        tenant, origin = request.query_params.get("tenant", ""), request.query_params.get("origin", "")
        if not tenant or not origin:
            return render(request, "error.html", 400, message="An endpoint is a tenant and an origin: "
                                                              "open it from the overview's list.")
        scope = Scope(tenant=tenant, origin=origin)
        try:
            window = health_window(request.query_params.get("window"))
        except BadInput as exc:
            return render(request, "error.html", 400, message=str(exc))
        async with state["reader"].connect() as conn:
            health = await queries.health(conn, scope)
            rollup = await health_stats.endpoint_health(conn, window_seconds=window[1], tenant=tenant, origin=origin)
            found = await queries.breaker(conn, tenant, origin)
            counts = await queries.state_counts(conn, scope)
            drawn = await charts_for(conn, scope, health.now)
            failures = await queries.failed_attempts(conn, scope, health.now - DAY.seconds, FAILURES_SHOWN)
        return render(request, "endpoint.html", refreshes=True, tenant=tenant, origin=origin, health=health,
                      rollup=rollup[0] if rollup else None, window=window[0],
                      windows={name: here(request, window=name) for name in HEALTH_WINDOWS}, breaker=found,
                      counts=counts, charts=drawn, failures=failures, now=health.now)

    async def messages(request: Request) -> Response:
        if not signed_in(request):
            return RedirectResponse("/login", status_code=303)
        params = {f: request.query_params.get(f, "") for f in FILTER_FIELDS}
        context: dict[str, Any] = {"params": params, "states": STATES, "reasons": DEAD_REASONS, "searched": any(params.values())}
        try:
            filters = filters_from(request.query_params)
            before = page_start(request.query_params.get("before"))
        except BadInput as exc:
            return render(request, "messages.html", 400, page=None, error=str(exc), now=0.0, **context)
        async with state["reader"].connect() as conn:
            page = await queries.message_page(conn, filters, before, PAGE_SIZE)
            now = await store.db_now(conn)
        older = here(request, before=page.older) if page.older else None
        newest = here(request, before=None) if before is not None else None
        return render(request, "messages.html", page=page, older=older, newest=newest, now=now, **context)

    async def message(request: Request) -> Response:
        if not signed_in(request):
            return RedirectResponse("/login", status_code=303)
        ref = request.path_params["ref"]
        async with state["reader"].connect() as conn:
            try:
                data = await ops.show(conn, ref, settings.sealing())
            except ops.AmbiguousReference:
                return render(request, "error.html", 400, message="Several tenants use that idempotency key: "
                                                                  "open the message by its id.")
            now = await store.db_now(conn)
        if data is None:
            return render(request, "error.html", 404, message="No such message.")
        payload = json.dumps(data.pop("payload"), indent=2, sort_keys=True)
        return render(request, "message.html", m=data, payload=payload, now=now)

    async def replay_action(request: Request) -> Response:
        form = await action_form(request)
        if isinstance(form, Response):
            return form
        typed = [i if isinstance(i, str) else "" for i in form.getlist("id")]
        ids = [n for i in typed if (n := ops.row_id(i)) is not None]
        if len(ids) < len(typed):
            return render(request, "error.html", 400, message="A message to replay is named by its id: "
                                                              "a whole number from 1.")
        try:
            filters = None if ids else filters_from(form, limit=replay_limit(form.get("limit")))
        except BadInput as exc:
            return render(request, "error.html", 400, message=str(exc))
        if filters is not None and not any(form.get(f) for f in FILTER_FIELDS):
            return render(request, "error.html", 400, message="A replay of matching messages needs at least one "
                                                              "search field filled in.")
        confirming = form.get("confirm") == "yes"
        token = str(form.get("once") or "")
        if confirming and not confirmations.known(token):
            return render(request, "error.html", 400, message="This confirmation is not one the console issued, "
                                                              "or it has forgotten it: review the replay again.")

        def run(dry_run: bool) -> Awaitable[ReplayResult]:
            return replay(state["engine"], ids=ids, filters=filters, force=False, dry_run=dry_run,
                          horizon_seconds=settings.retry_horizon_seconds)

        try:
            if not confirming:
                return await replay_page(request, await run(True), once=confirmations.issue())
            # A replay that fails part-way returns what its committed chunks replayed (ReplayResult.error);
            # one refused before it began (a key several tenants use) leaves the confirmation unspent.
            await confirmations.act_once(token, lambda: run(False))
        except ops.AmbiguousReference:
            return render(request, "error.html", 400, message="Several tenants use that idempotency key: "
                                                              "fill in the tenant too, or replay by id.")
        return RedirectResponse(f"/replay/done?{urlencode({'once': token})}", status_code=303)

    async def replay_done(request: Request) -> Response:
        """What a confirmed replay did, shown as often as asked: reading it replays nothing."""
        if not signed_in(request):
            return RedirectResponse("/login", status_code=303)
        result = confirmations.outcome(request.query_params.get("once", ""))
        if not isinstance(result, ReplayResult):  # unknown (every post waits for the replay to finish)
            return render(request, "error.html", 404, message="No finished replay under that confirmation: "
                                                              "the console may have restarted since.")
        return await replay_page(request, result)

    async def replay_page(request: Request, result: ReplayResult, once: str | None = None) -> Response:
        async with state["reader"].connect() as conn:
            listed = await queries.messages_by_id(conn, result.replayed)
            now = await store.db_now(conn)
        return render(request, "replay.html", result=result, listed=listed, now=now, once=once)

    async def reset_breaker(request: Request) -> Response:
        """A reset is asked, confirmed, then done: the first post shows what would be reset."""
        form = await action_form(request)
        if isinstance(form, Response):
            return form
        tenant, origin = str(form.get("tenant") or ""), str(form.get("origin") or "")
        if form.get("confirm") != "yes":
            async with state["reader"].connect() as conn:
                found = await queries.breaker(conn, tenant, origin)
                now = await store.db_now(conn)
            return render(request, "reset.html", tenant=tenant, origin=origin, breaker=found, now=now)
        async with state["engine"].begin() as conn:
            done = await ops.reset_breaker(conn, tenant, origin)
        back = urlencode({"tenant": tenant, "origin": origin, "notice": "breaker-reset" if done else "breaker-missing"})
        return RedirectResponse(f"/endpoint?{back}", status_code=303)

    async def logout(request: Request) -> Response:
        form = await action_form(request)
        if isinstance(form, Response):
            return form
        sessions.sign_out(request.cookies.get(COOKIE))
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(COOKIE, path="/")
        return response

    kit = Kit(render=render, action_form=action_form, signed_in=signed_in, engine=lambda: state["engine"],
              reader=lambda: state["reader"], confirmations=confirmations)
    return Starlette(lifespan=lifespan, middleware=[Middleware(SecurityHeaders)], exception_handlers={DataError: unstorable_value, SQLAlchemyError: database_unavailable}, routes=[
        *recovery.routes(kit),
        Route("/login", login, methods=["GET", "POST"]),
        Route("/replay/done", replay_done),
        Route("/", overview),
        Route("/endpoint", endpoint),
        Route("/messages", messages),
        Route("/messages/{ref}", message),
        Route("/replay", replay_action, methods=["POST"]),
        Route("/breakers/reset", reset_breaker, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ])
