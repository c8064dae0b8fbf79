"""``outboxd subscribers list|show``: the operator's view of account-level subscribers.

Credential-free, like the buyer's own readback: the legacy scheme is named, never its
secret. ``show`` adds the subscriber's URL proof (the challenge message and its attempts)
and its fires by state, so "why does this buyer get nothing?" has a one-command answer.
"""

from __future__ import annotations

import argparse
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox import protocol
from outbox.config import Settings
from outbox.schema import SUBSCRIBER_STATES, attempts, messages, subscribers
from outbox.subscribers import Subscriber, _record
from outbox.urls import public_url
from supervisor.cli.common import Subcommands, UsageError, UserError, positive_int, print_json, run_async, table
from supervisor.operator.ops import rfc3339


def _public(record: Subscriber, row: Any) -> dict[str, Any]:
    data = {"tenant_id": record.tenant_id, "account_id": record.account_id, "principal_id": record.principal_id,
            **record.config_state(), "state": record.state, "created_at": rfc3339(row.created_at),
            "updated_at": rfc3339(row.updated_at), "proven_at": rfc3339(record.proven_at),
            "challenge_message_id": record.challenge_message_id}
    data["url"] = public_url(data["url"])  # query strings may carry buyer secrets
    return data


async def list_rows(conn: AsyncConnection, *, tenant: str | None, account: str | None,
                    state: str | None, limit: int) -> list[dict[str, Any]]:
    query = select(subscribers)
    for column, value in ((subscribers.c.tenant_id, tenant), (subscribers.c.account_id, account),
                          (subscribers.c.state, state)):
        if value is not None:
            query = query.where(column == value)
    query = query.order_by(subscribers.c.tenant_id, subscribers.c.account_id, subscribers.c.subscriber_id)
    found = list(await conn.execute(query.limit(limit)))
    held: dict[int, int] = dict((await conn.execute(  # fires waiting on a proof: never silent (docs/subscribers.md)
        select(messages.c.subscriber_ref, func.count()).where(
            messages.c.held, messages.c.subscriber_ref.in_([r.id for r in found]))
        .group_by(messages.c.subscriber_ref))).all()) if found else {}
    return [{**_public(_record(r), r), "held_fires": int(held.get(r.id, 0))} for r in found]


async def counts_by_state(conn: AsyncConnection) -> dict[str, int]:
    """Subscribers per state (``outboxd status``)."""
    rows = await conn.execute(select(subscribers.c.state, func.count()).group_by(subscribers.c.state))
    return {state: int(n) for state, n in sorted(rows.all())}


async def show_row(conn: AsyncConnection, tenant: str, account: str, subscriber_id: str) -> dict[str, Any] | None:
    row = (await conn.execute(select(subscribers).where(
        subscribers.c.tenant_id == tenant, subscribers.c.account_id == account,
        subscribers.c.subscriber_id == subscriber_id))).first()
    if row is None:
        return None
    data = _public(_record(row), row)
    fires = await conn.execute(
        select(messages.c.state, func.count()).where(messages.c.subscriber_ref == row.id,
                                                     messages.c.notification_type != protocol.CHALLENGE_TYPE)
        .group_by(messages.c.state))
    data["fires"] = {state: int(n) for state, n in sorted(fires.all())}
    data["held_fires"] = int((await conn.execute(select(func.count()).where(
        messages.c.subscriber_ref == row.id, messages.c.held))).scalar_one())
    proof = None
    if row.challenge_message_id is not None:
        message = (await conn.execute(select(messages.c.id, messages.c.state, messages.c.dead_reason,
                                             messages.c.attempts, messages.c.last_error)
                                      .where(messages.c.id == row.challenge_message_id))).first()
        tries = await conn.execute(select(attempts.c.attempt_number, attempts.c.outcome, attempts.c.http_status,
                                          attempts.c.error, attempts.c.occurred_at)
                                   .where(attempts.c.message_id == row.challenge_message_id)
                                   .order_by(attempts.c.attempt_number, attempts.c.id))
        proof = {**(dict(message._mapping) if message else {"id": row.challenge_message_id, "state": "purged"}),
                 "attempts_log": [{**a._mapping, "occurred_at": rfc3339(a.occurred_at)} for a in tries]}
    data["proof"] = proof
    return data


def cmd_subscribers(args: argparse.Namespace, settings: Settings) -> int:
    if args.action == "list":
        rows = run_async(settings, lambda conn: list_rows(conn, tenant=args.tenant, account=args.account,
                                                          state=args.state, limit=args.limit), reads_only=True)
        if args.json:
            print_json(rows)
        else:
            table([(r["tenant_id"], r["account_id"], r["subscriber_id"], r["state"], r["held_fires"],
                    ",".join(r["event_types"]), r["proven_at"] or "-", r["url"]) for r in rows],
                  ["TENANT", "ACCOUNT", "SUBSCRIBER", "STATE", "HELD", "EVENTS", "PROVEN", "URL"])
        return 0
    if not (args.tenant and args.account and args.subscriber):
        raise UsageError("show needs --tenant, --account and SUBSCRIBER_ID")
    data = run_async(settings, lambda conn: show_row(conn, args.tenant, args.account, args.subscriber), reads_only=True)
    if data is None:
        raise UserError(f"no subscriber {args.subscriber!r} on {args.tenant}/{args.account}")
    if args.json:
        print_json(data)
        return 0
    for key in ("tenant_id", "account_id", "subscriber_id", "principal_id", "state", "active", "url", "proven_at"):
        print(f"{key:14} {data[key] if data[key] is not None else '-'}")
    print(f"{'event_types':14} {', '.join(data['event_types'])}")
    print(f"{'auth':14} {(data.get('authentication') or {'schemes': ['rfc9421']})['schemes'][0]}")
    print(f"{'fires':14} {', '.join(f'{k} {v}' for k, v in data['fires'].items()) or 'none'}"
          f" (held {data['held_fires']})")
    proof = data["proof"]
    if proof:
        print(f"{'proof':14} message {proof['id']} {proof['state']} {proof.get('dead_reason') or ''}".rstrip())
        table([(a["attempt_number"], a["occurred_at"], a["outcome"], a["http_status"], a["error"])
               for a in proof["attempts_log"]], ["ATTEMPT", "AT", "OUTCOME", "HTTP", "ERROR"])
    return 0


def register(add: Subcommands) -> None:
    p = add("subscribers", "List account-level subscribers, or show one with its URL proof.", cmd_subscribers)
    p.add_argument("action", choices=["list", "show"])
    p.add_argument("subscriber", nargs="?", metavar="SUBSCRIBER_ID", help="show: the subscriber_id")
    p.add_argument("--tenant", help="tenant id")
    p.add_argument("--account", help="account id")
    p.add_argument("--state", choices=SUBSCRIBER_STATES, help="list: by state")
    p.add_argument("--limit", type=positive_int, default=100, help="list: at most this many (default 100)")
    p.add_argument("--json", action="store_true", help="print JSON")
