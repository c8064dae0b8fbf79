"""``outboxd recover``: recovery as a background job the daemons run (supervisor/operator/jobs.py)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from outbox.config import Settings
from outbox.schema import DEAD_REASONS
from supervisor.operator.jobs import DEFAULT_RATE, LISTED, Selection, parse_rate
from supervisor.cli.common import (
    Subcommands,
    UsageError,
    UserError,
    endpoint_origin_arg,
    parse_time,
    positive_int,
    print_json,
    run_async,
    table,
)


def _positive_rate(text: str) -> float:
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _print_job(job: dict[str, Any]) -> None:
    scope = job["tenant_id"] + (f"@{job['origin']}" if job["origin"] else "")
    if job["kind"] == "cancel":
        print(f"job {job['id']}  {job['state']}  cancel pending  {scope}  enqueued {job['since']} to {job['until']}")
        print(f"  cancelled {job['done']}/{job['total']}, skipped {job['skipped']} (in flight or no longer pending), "
              f"{_left(job)}at most {job['rate']:g}/s; updated {job['updated_at']}")
        return
    print(f"job {job['id']}  {job['state']}  {scope}  reason={job['reason'] or 'any'}  since {job['since']}"
          f"{'  --force' if job['force'] else ''}")
    print(f"  replayed {job['done']}/{job['total']}, skipped {job['skipped']} (past the horizon without --force), "
          f"{_left(job)}at most {job['rate']:g}/s; updated {job['updated_at']}")


def _left(job: dict[str, Any]) -> str:
    return f"{job['left']} left the selection before it reached them, " if job["left"] else ""


def _selection(args: argparse.Namespace) -> Selection:
    """The job ``recover start`` asks for, refusing options that do not fit its kind as a
    malformed command line (exit status 2, docs/operations.md)."""
    if not args.tenant:
        raise UsageError("recover start needs --tenant")
    if args.cancel_pending:
        if args.reason or args.force:
            raise UsageError("--reason and --force select dead messages to replay; --cancel-pending takes pending ones")
        if args.since is not None and args.until is not None and args.until < args.since:
            raise UsageError("--until is before --since")
        return Selection(args.tenant, args.since or 0.0, args.origin, kind="cancel", until=args.until)
    if args.since is None:
        raise UsageError("recover start needs --since (a time, or a duration ago like 6h)")
    if args.until is not None:
        raise UsageError("--until bounds --cancel-pending's enqueue times; a replay takes what ended dead until now")
    return Selection(args.tenant, args.since, args.origin, args.reason)


def cmd_recover(args: argparse.Namespace, settings: Settings) -> int:
    from supervisor.operator import jobs

    if args.action == "start":
        selection = _selection(args)
        verb, doing, what = ("cancel", "cancelling", "pending or in-flight") if args.cancel_pending else \
            ("replay", "replaying", "dead")
        if args.dry_run:
            matched = run_async(settings, lambda conn: jobs.count(conn, selection), reads_only=True)
            print_json({f"would_{verb}": matched}) if args.json else print(f"would {verb} {matched} {what} message(s)")
            return 0
        if args.force:
            print("warning: --force replays past the retry horizon; the receiver's dedup window may be gone, "
                  "so it may act on a message twice", file=sys.stderr)
        job = run_async(settings, lambda conn: jobs.create(conn, selection, force=args.force, rate=args.rate))
        if args.json:
            print_json(job)
        else:
            print(f"job {job['id']}: {doing} {job['total']} {what} message(s) in the background, at most "
                  f"{job['rate']:g}/s; follow it with `outboxd recover show {job['id']}`")
        return 0
    if args.action == "list":
        rows, total = run_async(settings, lambda conn: jobs.list_jobs(conn, args.limit), reads_only=True)
        if total > len(rows):
            print(f"showing the newest {len(rows)} of {total} jobs: raise --limit", file=sys.stderr)
        if args.json:
            print_json(rows)
        else:
            table([(j["id"], j["kind"], j["state"], j["tenant_id"], j["origin"], j["reason"],
                    f"{j['done']}/{j['total']}", j["skipped"], j["rate"], j["created_at"]) for j in rows],
                  ["JOB", "KIND", "STATE", "TENANT", "ORIGIN", "REASON", "DONE", "SKIPPED", "RATE", "CREATED"])
        return 0
    if args.job is None:
        raise UsageError(f"recover {args.action} needs a job id (see `outboxd recover list`)")
    if args.action == "show":
        job = run_async(settings, lambda conn: jobs.show(conn, args.job), reads_only=True)
        if job is None:
            raise UserError(f"no job {args.job}")
        print_json(job) if args.json else _print_job(job)
        return 0
    if not run_async(settings, lambda conn: jobs.change(conn, args.job, args.action)):
        job = run_async(settings, lambda conn: jobs.show(conn, args.job))
        raise UserError(f"no job {args.job}" if job is None else
                        f"job {args.job} is {job['state']}: it cannot {args.action} from that state")
    print(f"job {args.job}: {args.action} done")
    return 0


def register(add: Subcommands) -> None:
    p = add("recover", "Replay a tenant's dead messages (or, with --cancel-pending, end its pending ones) as a durable "
                       "background job the daemons run: start (with --dry-run to count first), list, show, pause, "
                       "resume, cancel.", cmd_recover)
    p.add_argument("action", choices=["start", "list", "show", "pause", "resume", "cancel"])
    p.add_argument("job", nargs="?", type=positive_int, metavar="JOB", help="job id (show, pause, resume, cancel)")
    p.add_argument("--tenant", help="start: the tenant whose dead messages to replay (or pending ones to cancel)")
    p.add_argument("--cancel-pending", action="store_true",
                   help="start: end the tenant's pending messages dead 'cancelled' instead of replaying dead ones")
    p.add_argument("--since", type=parse_time, help="start: messages that ended dead since (ISO time, or 6h ago); "
                                                    "with --cancel-pending, enqueued since (default: any time)")
    p.add_argument("--until", type=parse_time, help="start --cancel-pending: enqueued until (default: now)")
    p.add_argument("--origin", type=endpoint_origin_arg,
                   help="start: only this endpoint's origin, e.g. https://buyer.example.com (any URL of it)")
    p.add_argument("--reason", choices=DEAD_REASONS, help="start: only this dead reason")
    p.add_argument("--limit", type=positive_int, default=LISTED,
                   help=f"list: at most this many, newest first (default {LISTED})")
    p.add_argument("--force", action="store_true", help="start: also replay past the retry horizon "
                                                        "(a fresh horizon, as `outboxd replay --force`)")
    p.add_argument("--rate", type=_positive_rate, default=float(DEFAULT_RATE),
                   help=f"start: messages per second at most (default {DEFAULT_RATE})")
    p.add_argument("--dry-run", action="store_true", help="start: only count what would be replayed")
    p.add_argument("--json", action="store_true", help="print JSON")
