"""``outboxd status | list | show | replay | breakers | purge``: the operator's message tools."""

from __future__ import annotations

import argparse
import re
import json
import sys
from typing import Any

from outbox.bodies import encryption_summary, unopenable_rows
from outbox.keyset import read_ledger
from supervisor.cycle.resealer import held_line
from outbox.config import Settings
from outbox.schema import DEAD_REASONS, STATES
from supervisor.cli.common import (
    Subcommands,
    UsageError,
    UserError,
    endpoint_origin_arg,
    parse_duration,
    parse_time,
    positive_int,
    print_json,
    run_async,
    table,
    with_engine,
)


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    from supervisor.operator import ops

    from supervisor.cli.subscribers import counts_by_state
    from supervisor.keys.keyring import read_snapshot

    async def work(conn: Any) -> dict[str, Any]:
        keys = await conn.run_sync(read_snapshot)
        ledger = await conn.run_sync(read_ledger)
        held = await unopenable_rows(conn, settings.sealing())
        return {**await ops.status(conn, top=args.top), "subscribers": await counts_by_state(conn),
                "signing_paused": list(keys.paused(keys.now).values()), "signing_keys": len(keys.records),
                "encryption": encryption_summary(settings, ledger.sealing_key_id),
                "sealed_unopenable": held_line(held, "this configuration"),
                "held_by_processes": {r.reader_id: r.unopenable for r in ledger.live() if r.unopenable}}

    data = run_async(settings, work, reads_only=True)
    # Messages waiting on the operator (no signing key, a missing encryption key) fail the
    # command, so a script or a probe running `outboxd status` sees them.
    held = 1 if data["signing_paused"] or data["sealed_unopenable"] or data["held_by_processes"] else 0
    if args.json:
        print_json(data)
        return held
    m = data["messages"]
    print(f"messages   pending {m['pending']}  in_flight {m['in_flight']}  delivered {m['delivered']}  "
          f"dead {m['dead']}")
    if not m["pending"]:
        print("oldest due none (nothing pending)")
    elif data["next_due_in_seconds"] is not None:  # every pending message waits out a back-off
        print(f"oldest due none (all pending in back-off, the next due in {data['next_due_in_seconds']:.1f} s)")
    else:
        print(f"oldest due {data['oldest_due_age_seconds']:.1f} s")
    print("dead       " + (", ".join(f"{k} {v}" for k, v in data["dead_by_reason"].items()) or "none"))
    print("breakers   " + (", ".join(f"{b['tenant_id']}@{b['origin']} {b['state']} ({b['failures']} failures, "
                                     f"{b['trips']} trips)" for b in data["open_breakers"])
                           or "all closed"))
    print(f"encryption {data['encryption']}")
    if data["sealed_unopenable"] is not None:
        print(f"HELD       {data['sealed_unopenable']}")
    for reader, count in data["held_by_processes"].items():
        print(f"HELD       {held_line(count, reader)}")
    print("backlog    " + (", ".join(f"{t['tenant_id']} {t['backlog']}" for t in data["top_tenants_by_backlog"])
                           or "none"))
    print("subscribers " + (", ".join(f"{k} {v}" for k, v in data["subscribers"].items()) or "none"))
    print("signing    " + ("; ".join(data["signing_paused"]) or (
        "every scope has an active key" if data["signing_keys"] else
        "no key yet: `outboxd run` registers OUTBOX_SIGNING_KEY_FILE's (`outboxd keys generate --out FILE`) "
        "at its first start")))
    return held


def filters_of(args: argparse.Namespace) -> Any:
    from supervisor.operator.ops import Filters

    return Filters(state=args.state, reason=args.reason, tenant=args.tenant, key=args.key, url=args.url,
                   origin=args.origin, since=args.since, until=args.until, limit=args.limit)


def cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    from supervisor.operator import ops

    filters = filters_of(args)

    async def work(conn: Any) -> tuple[list[dict[str, Any]], int]:
        rows = await ops.list_messages(conn, filters)
        return rows, (await ops.count_matching(conn, filters) if len(rows) == filters.limit else len(rows))

    rows, matched = run_async(settings, work, reads_only=True)
    if matched > len(rows):
        print(f"showing the first {len(rows)} of {matched} matching messages: raise --limit or narrow the filter",
              file=sys.stderr)
    if args.json:
        print_json(rows)
        return 0
    table([(r["id"], r["tenant_id"], r["state"] + (" (held)" if r["held"] else ""), r["dead_reason"], r["attempts"],
            r["sequence_number"], r["subscriber_id"], r["idempotency_key"], r["created_at"], r["url"]) for r in rows],
          ["ID", "TENANT", "STATE", "REASON", "ATTEMPTS", "SEQ", "SUBSCRIBER", "IDEMPOTENCY_KEY", "CREATED", "URL"])
    return 0


def cmd_show(args: argparse.Namespace, settings: Settings) -> int:
    from supervisor.operator import ops

    data = run_async(settings, lambda conn: ops.show(conn, args.ref, settings.sealing()), reads_only=True)
    if data is None:
        raise UserError(f"no message with id or idempotency key {args.ref!r}")
    if args.json:
        print_json(data)
        return 0
    for key in ("id", "tenant_id", "state", "dead_reason", "idempotency_key", "sequence_number", "url",
                "auth_mode", "attempts", "trigger", "last_status", "last_error", "created_at", "first_attempt_at",
                "next_attempt_at", "retry_until", "finished_at", "notification_type", "account_id", "subscriber_id",
                "subscriber_state", "principal_id", "held"):
        print(f"{key:17} {data.get(key) if data.get(key) is not None else '-'}")
    print(f"{'payload_size':17} {data['payload_size'] if data.get('payload_size') is not None else '-'}")
    payload = data.get("payload")
    print("payload          " + ("-" if payload is None else payload if isinstance(payload, str)
                                 else json.dumps(payload, indent=2, ensure_ascii=False).replace("\n", "\n" + " " * 17)))
    print()
    table([(a["attempt_number"], a["occurred_at"], a["outcome"], a["http_status"], a["response_time_ms"],
            a["trigger"], a["error"], a["response_excerpt"]) for a in data["attempt_trail"]],
          ["ATTEMPT", "AT", "OUTCOME", "HTTP", "MS", "TRIGGER", "ERROR", "RESPONSE"])
    return 0


def cmd_replay(args: argparse.Namespace, settings: Settings) -> int:
    from supervisor.operator.replay import replay

    filtered = any((args.state, args.reason, args.tenant, args.key, args.url, args.origin, args.since, args.until))
    if not args.ids and not filtered:
        raise UsageError("name message ids or at least one filter (--state, --reason, --tenant, --key, --url, "
                         "--origin, --since)")
    if args.ids and filtered:
        raise UsageError("name message ids or filters, not both")
    if args.force:
        print("warning: --force replays past the retry horizon; the receiver's dedup window may be gone, "
              "so it may act on the message twice", file=sys.stderr)
    result = with_engine(settings, lambda engine: replay(
        engine, ids=args.ids, filters=filters_of(args) if filtered else None, force=args.force,
        horizon_seconds=settings.retry_horizon_seconds,
        dry_run=args.dry_run, progress=None if args.json else
        lambda done, total: print(f"replayed {done}/{total}", file=sys.stderr)))
    if args.json:
        print_json(result.as_dict())
    else:
        print(f"{'would replay' if args.dry_run else 'replayed'} {len(result.replayed)} message(s): "
              f"{', '.join(map(str, result.replayed)) or '-'}")
        for item in result.refused:
            print(f"refused {item['id']}: {item['why']}")
        for item in result.missing:
            print(f"not found: {item}")
        if result.more_matched:
            print(f"{result.more_matched} more matched, left alone: raise --limit (now {args.limit}) "
                  "or narrow the filter")
    if result.error is not None:  # stderr, in JSON too: the listed ones are replayed, the rest not
        print(f"outboxd replay: stopped part-way, the rest not replayed: database error: {result.error}",
              file=sys.stderr)
    return 0 if result.complete else 1


_BREAKER_KEY = re.compile(r"(.+?)@(https?://.*)", re.IGNORECASE | re.DOTALL)


def _breaker_key(key: str) -> tuple[str, str]:
    """``TENANT@ORIGIN`` as the breaker's row key; the origin may be any URL of the endpoint.
    The tenant ends at the first ``@`` that starts an ``http(s)://`` URL, so a tenant id may
    hold ``@`` (``ops@acme.example@https://buyer.example``, as ``breakers list`` prints it)."""
    split = _BREAKER_KEY.match(key)
    tenant, rest = split.groups() if split else ("", "")
    try:
        origin = endpoint_origin_arg(rest) if tenant else None
    except argparse.ArgumentTypeError:
        origin = None
    if origin is None:
        raise UsageError(f"breaker key {key!r} must be TENANT@ORIGIN, e.g. acme@https://buyer.example.com")
    return tenant, origin


def cmd_breakers(args: argparse.Namespace, settings: Settings) -> int:
    from supervisor.operator import ops

    if args.action == "reset":
        if not args.key:
            raise UsageError("breakers reset needs a key: TENANT@ORIGIN (see `outboxd breakers list`)")
        tenant, origin = _breaker_key(args.key)
        found = run_async(settings, lambda conn: ops.reset_breaker(conn, tenant, origin))
        if not found:
            raise UserError(f"no breaker {tenant}@{origin}")
        print(f"breaker {tenant}@{origin} reset (closed)")
        return 0
    rows = run_async(settings, ops.list_breakers, reads_only=True)
    if args.json:
        print_json(rows)
    else:
        table([(f"{r['tenant_id']}@{r['origin']}", r["state"], r["failures"], r["trips"], r["open_until"])
               for r in rows], ["KEY", "STATE", "FAILURES", "TRIPS", "OPEN_UNTIL"])
    return 0


def cmd_purge(args: argparse.Namespace, settings: Settings) -> int:
    from outbox import store
    from outbox.db import is_postgresql
    from outbox.partitions import drop_attempt_partitions

    # Attempt rows back buyers' webhook_activity[]: never purged inside its retention.
    older_than = max(args.older_than, settings.activity_retention_days * 86400.0)
    if older_than > args.older_than and not args.json:
        print(f"keeping {settings.activity_retention_days} days of history for webhook_activity "
              "(OUTBOX_ACTIVITY_RETENTION_DAYS)", file=sys.stderr)

    async def work(engine: Any) -> tuple[int, list[str]]:
        # PostgreSQL: attempt history older than the retention goes by whole partitions first
        dropped = (await drop_attempt_partitions(engine, older_than=older_than, dry_run=args.dry_run)
                   if is_postgresql(settings.database_url) else [])
        if args.dry_run:
            async with engine.connect() as conn:
                return await store.purge_count(conn, older_than=older_than,
                                               horizon_seconds=settings.retry_horizon_seconds), dropped
        total = 0
        while True:  # one short transaction per batch: never a long lock on the table
            async with engine.begin() as conn:
                n = await store.purge_batch(conn, older_than=older_than,
                                            horizon_seconds=settings.retry_horizon_seconds, limit=args.batch)
            total += n
            if n < args.batch:
                return total, dropped

    total, dropped = with_engine(settings, work)
    if args.json:
        print_json({"dry_run": args.dry_run, "deleted": total, "dropped_attempt_partitions": dropped})
    elif args.dry_run:
        print(f"would delete {total} finished message(s) and their attempts; would drop {len(dropped)} attempt "
              f"partition(s) older than the retention{': ' + ', '.join(dropped) if dropped else ''}")
    else:
        print(f"deleted {total} finished message(s) and their attempts; "
              f"dropped {len(dropped)} attempt partition(s) older than the retention")
    return 0


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")


def _filter_flags(p: argparse.ArgumentParser, limit: int) -> None:
    p.add_argument("--state", choices=STATES)
    p.add_argument("--reason", choices=DEAD_REASONS, help="dead reason")
    p.add_argument("--tenant", help="tenant id")
    p.add_argument("--key", help="idempotency key")
    p.add_argument("--url", help="substring of the webhook URL")
    p.add_argument("--origin", type=endpoint_origin_arg,
                   help="the endpoint: any URL of it, matched by its origin exactly (a substring --url also "
                        "matches https://buyer.example.com:8443 for https://buyer.example.com)")
    p.add_argument("--since", type=parse_time, help="created at or after (ISO time, or a duration ago: 2h)")
    p.add_argument("--until", type=parse_time, help="created before (ISO time, or a duration ago)")
    p.add_argument("--limit", type=positive_int, default=limit, help=f"at most this many (default {limit})")


def register(add: Subcommands) -> None:
    p = add("status", "Counts by state, oldest due message, open breakers, dead by reason, top backlogs.",
            cmd_status)
    p.add_argument("--top", type=positive_int, default=5, help="tenants to show by backlog (default 5)")
    _json_flag(p)
    p = add("list", "List messages.", cmd_list)
    _filter_flags(p, 100)
    _json_flag(p)
    p = add("show", "Show one message and every attempt.", cmd_show)
    p.add_argument("ref", metavar="ID|IDEMPOTENCY_KEY")
    _json_flag(p)
    p = add("replay", "Deliver finished messages again: same bytes, same key, trigger 'replay'. "
                      "Exits 1 unless everything selected was replayed.", cmd_replay)
    p.add_argument("ids", nargs="*", type=positive_int, metavar="ID", help="message ids (or use filters)")
    _filter_flags(p, 1000)
    p.add_argument("--dry-run", action="store_true", help="print what would be replayed")
    p.add_argument("--force", action="store_true", help="also replay messages past their retry horizon")
    _json_flag(p)
    p = add("breakers", "List circuit breakers or reset one.", cmd_breakers)
    p.add_argument("action", choices=["list", "reset"])
    p.add_argument("key", nargs="?", metavar="TENANT@ORIGIN")
    _json_flag(p)
    p = add("purge", "Delete delivered and dead history older than the retention.", cmd_purge)
    p.add_argument("--older-than", type=parse_duration, required=True, metavar="DURATION",
                   help="retention, e.g. 30d; nothing inside its retry horizon or the activity "
                        "retention (OUTBOX_ACTIVITY_RETENTION_DAYS, >= 30) is ever deleted")
    p.add_argument("--batch", type=positive_int, default=1000, help="rows per transaction (default 1000)")
    p.add_argument("--dry-run", action="store_true", help="count what would be deleted, delete nothing")
    _json_flag(p)
