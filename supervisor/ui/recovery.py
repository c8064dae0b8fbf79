"""The console's recovery jobs: the list with each job's progress, a job's page, and start
(a dry-run count first, then a confirmation) of a replay of dead messages or a cancel of
pending ones, pause, resume and cancel (asked first).

Every change goes through :mod:`supervisor.operator.jobs`, the code ``outboxd recover`` runs, so the
console starts exactly the job the CLI would. A job started here never uses ``--force``: a
message past its retry horizon is skipped and counted, as the console's replay refuses it.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from outbox import store
from outbox.schema import DEAD_REASONS
from supervisor.operator import jobs
from supervisor.operator.ops import rfc3339, row_id
from supervisor.ui.forms import JOB_RATE_DEFAULT, BadInput, job_rate, job_selection
from supervisor.ui.kit import Kit

# The banners a job action may ask for (see app.NOTICES: fixed words, never the address's).
NOTICES = {
    "job-started": "Recovery job started: the daemons run it in the background.",
    "job-paused": "Job paused: it takes no more messages until it is resumed.",
    "job-resumed": "Job resumed: a daemon picks it up again within a second.",
    "job-cancelled": "Job cancelled: what it did stays done; it takes no more messages.",
    "job-unchanged": "Nothing changed: the job had already moved to another state.",
}
DONE_WORDS = {"pause": "job-paused", "resume": "job-resumed", "cancel": "job-cancelled"}


def routes(kit: Kit) -> list[Route]:
    """The recovery pages, signed in and CSRF-checked like every other page of ``kit``'s app."""

    async def job_list(request: Request) -> Response:
        if not kit.signed_in(request):
            return RedirectResponse("/login", status_code=303)
        async with kit.reader().connect() as conn:
            listed, total = await jobs.list_jobs(conn)
            now = await store.db_now(conn)
        return kit.render(request, "jobs.html", refreshes=True, jobs=listed, total=total, now=now,
                          reasons=[r for r in DEAD_REASONS if r not in store.NEVER_REPLAYED],
                          rate_default=JOB_RATE_DEFAULT)

    async def job_page(request: Request) -> Response:
        if not kit.signed_in(request):
            return RedirectResponse("/login", status_code=303)
        number = row_id(request.path_params["job"])
        async with kit.reader().connect() as conn:
            job = None if number is None else await jobs.show(conn, number)
            now = await store.db_now(conn)
        if job is None:
            return kit.refuse(request, 404, "No such recovery job.")
        return kit.render(request, "job.html", refreshes=True, job=job, now=now, asking=None,
                          transitions=jobs.TRANSITIONS)

    async def start(request: Request) -> Response:
        """Counted first (the dry run), started only on the confirmation of that count."""
        form = await kit.action_form(request)
        if isinstance(form, Response):
            return form
        try:
            selection, rate = job_selection(form), job_rate(form.get("rate"))
        except BadInput as exc:
            return kit.refuse(request, 400, str(exc))
        if form.get("confirm") != "yes":
            async with kit.reader().connect() as conn:
                now = await store.db_now(conn)
                selection = jobs.in_database_time(selection, now)  # "1h" is an hour of the database's clock
                matched = await jobs.count(conn, selection)
            # the confirmation starts from this count's times
            return kit.render(request, "job_start.html", selection=selection, rate=rate, matched=matched,
                              since=rfc3339(selection.since), now=now, once=kit.confirmations.issue(),
                              until="" if selection.until is None else rfc3339(selection.until))
        token = str(form.get("once") or "")
        if not kit.confirmations.known(token):
            return kit.refuse(request, 400, "This confirmation is not one the console issued, or it has forgotten "
                                            "it: review the job again.")

        async def create() -> dict[str, Any]:
            async with kit.engine().begin() as conn:
                return await jobs.create(conn, selection, force=False, rate=rate)

        job = await kit.confirmations.act_once(token, create)  # a second post: the first's job, not another
        return RedirectResponse(f"/jobs/{job['id']}?notice=job-started", status_code=303)

    async def change(request: Request) -> Response:
        """Pause and resume at once; cancel asks first, since a cancelled job cannot go on."""
        form = await kit.action_form(request)
        if isinstance(form, Response):
            return form
        number, action = row_id(request.path_params["job"]), request.path_params["action"]
        if number is None or action not in jobs.TRANSITIONS:
            return kit.refuse(request, 404, "No such recovery job or action.")
        if action == "cancel" and form.get("confirm") != "yes":
            async with kit.reader().connect() as conn:
                job = await jobs.show(conn, number)
                now = await store.db_now(conn)
            if job is None:
                return kit.refuse(request, 404, "No such recovery job.")
            return kit.render(request, "job.html", job=job, now=now, asking="cancel", transitions=jobs.TRANSITIONS)
        async with kit.engine().begin() as conn:
            done = await jobs.change(conn, number, action)
        notice = DONE_WORDS[action] if done else "job-unchanged"
        return RedirectResponse(f"/jobs/{number}?{urlencode({'notice': notice})}", status_code=303)

    return [
        Route("/jobs", job_list),
        Route("/jobs/start", start, methods=["POST"]),
        Route("/jobs/{job}", job_page),
        Route("/jobs/{job}/{action}", change, methods=["POST"]),
    ]
