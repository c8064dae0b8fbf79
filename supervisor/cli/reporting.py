"""``outboxd reporting``: the reporting hand-off's backlog, and its messages in outboxd.

The backlog is what the SDK's queues still hold (events not yet expanded, deliveries not
yet handed off), read through the factory ``OUTBOX_REPORTING_HANDOFF`` names; the messages
are the reporting notifications outboxd holds, by state and dead reason (docs/reporting.md).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox import protocol
from outbox.config import Settings
from outbox.schema import messages
from supervisor.cli.common import Subcommands, print_json, run_async
from supervisor.cycle.reporting_handoff import build_handoffs, close_all, total_backlog


async def message_counts(conn: AsyncConnection) -> dict[str, int]:
    """Reporting notifications in outboxd by state (dead ones by ``dead:<reason>``)."""
    rows = await conn.execute(
        select(messages.c.state, messages.c.dead_reason, func.count())
        .where(messages.c.notification_type.in_(sorted(protocol.PRINCIPAL_SCOPED_TYPES)))
        .group_by(messages.c.state, messages.c.dead_reason))
    return {state if reason is None else f"{state}:{reason}": int(n) for state, reason, n in sorted(rows.all(),
                                                                                                   key=str)}


async def sdk_backlog(settings: Settings) -> dict[str, int] | None:
    handoffs = await build_handoffs(settings)
    try:
        backlog = await total_backlog(handoffs)
    finally:
        await close_all(handoffs)
    return None if backlog is None else {"expansions": backlog.expansions, "deliveries": backlog.deliveries,
                                         "quarantined": backlog.quarantined}


def cmd_reporting(args: argparse.Namespace, settings: Settings) -> int:
    data: dict[str, Any] = {"handoff": settings.reporting_handoff,
                            "backlog": asyncio.run(sdk_backlog(settings)) if settings.reporting_handoff else None,
                            "messages": run_async(settings, message_counts, reads_only=True)}
    if args.json:
        print_json(data)
        return 0
    backlog = data["backlog"]
    print(f"{'handoff':9} {data['handoff'] or 'not configured (OUTBOX_REPORTING_HANDOFF)'}")
    print(f"{'backlog':9} " + ("unknown" if backlog is None else
                               f"{backlog['expansions']} events to expand, {backlog['deliveries']} deliveries "
                               "to hand off"))
    if backlog is not None and backlog["quarantined"]:
        print(f"{'lost':9} {backlog['quarantined']} deliveries quarantined in the SDK's queue, never to be sent "
              "(`reporting.quarantined` log lines name them; docs/reporting.md)")
    print(f"{'messages':9} {', '.join(f'{k} {v}' for k, v in data['messages'].items()) or 'none'}")
    return 0


def register(add: Subcommands) -> None:
    p = add("reporting", "Show the reporting hand-off's backlog and its messages by state.", cmd_reporting)
    p.add_argument("--json", action="store_true", help="print JSON")
