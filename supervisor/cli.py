"""``outboxd``: the daemon and the operator's tools.

Every subcommand exits 0 on success and prints a one-line error on stderr (exit 1) for
anything the user can fix; data-printing subcommands take ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from outbox.config import Settings, load_settings
from outbox.errors import ConfigurationError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class UserError(Exception):
    """A problem the user can fix: printed as one line, exit status 1."""


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``12h``, ``30d``, ``2w`` → seconds."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30d, 12h, 15m or 90s")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_time(text: str) -> float:
    """An ISO 8601 time, or a duration meaning that long ago (``2h``)."""
    try:
        return time.time() - parse_duration(text)
    except argparse.ArgumentTypeError:
        pass
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an ISO 8601 time nor a duration like 2h") from None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)).timestamp()


def _iso(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=lambda v: v.hex() if isinstance(v, bytes) else str(v)))


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> None:
    cells = [[str(c) for c in header]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def _with_engine(settings: Settings, work: Callable[[Any], Any]) -> Any:
    """Run ``await work(engine)`` against the configured database; the engine is disposed after."""
    from outbox.db import make_async_engine

    async def go() -> Any:
        engine = make_async_engine(settings.database_url)
        try:
            return await work(engine)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def _run_async(settings: Settings, work: Callable[[Any], Any]) -> Any:
    """Run ``await work(conn)`` in one transaction."""

    async def in_transaction(engine: Any) -> Any:
        async with engine.begin() as conn:
            return await work(conn)

    return _with_engine(settings, in_transaction)


# --------------------------------------------------------------------------- commands


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from outbox.db import make_engine
    from outbox.migrate import upgrade

    before, after = upgrade(make_engine(settings.database_url), args.revision)
    print(f"outbox schema: {before or 'empty'} -> {after}" if before != after else f"outbox schema: at {after}")
    return 0


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    from supervisor.daemon import Daemon, event_loop_factory
    from supervisor.logs import configure_logging
    from supervisor.outage import DatabaseUnavailable

    configure_logging(settings.log_format)
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(Daemon(settings).run())
    except DatabaseUnavailable as exc:
        raise UserError(str(exc)) from None
    return 0


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    from supervisor import ops

    data = _run_async(settings, lambda conn: ops.status(conn, top=args.top))
    if args.json:
        _print_json(data)
        return 0
    m = data["messages"]
    print(f"messages   pending {m['pending']}  in_flight {m['in_flight']}  delivered {m['delivered']}  dead {m['dead']}")
    print(f"oldest due {data['oldest_due_age_seconds']:.1f} s")
    print("dead       " + (", ".join(f"{k} {v}" for k, v in data["dead_by_reason"].items()) or "none"))
    print("breakers   " + (", ".join(f"{b['tenant_id']}@{b['origin']} {b['state']}" for b in data["open_breakers"])
                           or "all closed"))
    print("backlog    " + (", ".join(f"{t['tenant_id']} {t['backlog']}" for t in data["top_tenants_by_backlog"])
                           or "none"))
    return 0


def _filters(args: argparse.Namespace) -> Any:
    from supervisor.ops import Filters

    return Filters(state=args.state, reason=args.reason, tenant=args.tenant, url=args.url, since=args.since,
                   until=args.until, limit=args.limit)


def _print_messages(rows: list[dict[str, Any]]) -> None:
    _table([(r["id"], r["tenant_id"], r["state"], r["dead_reason"], r["attempts"], r["sequence_number"],
             r["idempotency_key"], _iso(r["created_at"]), r["url"]) for r in rows],
           ["ID", "TENANT", "STATE", "REASON", "ATTEMPTS", "SEQ", "IDEMPOTENCY_KEY", "CREATED", "URL"])


def cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    from supervisor import ops

    rows = _run_async(settings, lambda conn: ops.list_messages(conn, _filters(args)))
    if args.json:
        _print_json(rows)
    else:
        _print_messages(rows)
    return 0


def cmd_show(args: argparse.Namespace, settings: Settings) -> int:
    from supervisor import ops

    data = _run_async(settings, lambda conn: ops.show(conn, args.ref))
    if data is None:
        raise UserError(f"no message with id or idempotency key {args.ref!r}")
    if args.json:
        _print_json(data)
        return 0
    for key in ("id", "tenant_id", "state", "dead_reason", "idempotency_key", "sequence_number", "url",
                "auth_mode", "attempts", "trigger", "last_status", "last_error"):
        print(f"{key:17} {data[key] if data[key] is not None else '-'}")
    for key in ("created_at", "first_attempt_at", "next_attempt_at", "retry_until", "finished_at"):
        print(f"{key:17} {_iso(data[key])}")
    print()
    _table([(a["attempt_number"], _iso(a["occurred_at"]), a["outcome"], a["http_status"], a["response_time_ms"],
             a["trigger"], a["error"]) for a in data["attempts"]],
           ["ATTEMPT", "AT", "OUTCOME", "HTTP", "MS", "TRIGGER", "ERROR"])
    return 0


def cmd_replay(args: argparse.Namespace, settings: Settings) -> int:
    from outbox import store
    from supervisor import ops

    if not args.ids and not any((args.state, args.reason, args.tenant, args.url, args.since, args.until)):
        raise UserError("name message ids or at least one filter (--state, --reason, --tenant, --url, --since)")

    async def work(engine: Any) -> dict[str, Any]:
        async with engine.begin() as conn:
            ids = [int(i) for i in args.ids] if args.ids else await ops.select_ids(conn, _filters(args))
            candidates = await ops.replay_candidates(conn, ids)
        missing = sorted(set(ids) - {c["id"] for c in candidates})
        eligible = [c for c in candidates if c["replayable"] and (args.force or not c["past_horizon"])]
        refused = [c for c in candidates if c not in eligible]
        replayed: list[int] = []
        if not args.dry_run:
            chunk = 500
            for start in range(0, len(eligible), chunk):  # one short transaction per chunk
                async with engine.begin() as conn:
                    replayed += await store.replay(conn, [c["id"] for c in eligible[start:start + chunk]],
                                                   force=args.force)
                    await store.notify(conn)  # daemons start on each chunk as it commits
                if len(eligible) > chunk and not args.json:
                    print(f"replayed {len(replayed)}/{len(eligible)}", file=sys.stderr)
        return {"dry_run": args.dry_run, "would_replay" if args.dry_run else "replayed":
                [c["id"] for c in eligible] if args.dry_run else replayed,
                "refused": [{"id": c["id"], "state": c["state"],
                             "why": "past its retry horizon (use --force)" if c["replayable"] else
                             f"state is {c['state']}"} for c in refused],
                "missing": missing}

    if args.force:
        print("warning: --force replays past the retry horizon; the receiver's dedup window may be gone, "
              "so it may act on the message twice", file=sys.stderr)
    result = _with_engine(settings, work)
    if args.json:
        _print_json(result)
    else:
        done = result.get("would_replay", result.get("replayed"))
        print(f"{'would replay' if args.dry_run else 'replayed'} {len(done)} message(s): "
              f"{', '.join(map(str, done)) or '-'}")
        for item in result["refused"]:
            print(f"refused {item['id']}: {item['why']}")
        for item in result["missing"]:
            print(f"not found: {item}")
    return 0


def _breaker_key(key: str) -> tuple[str, str]:
    tenant, sep, rest = key.partition("@")
    if not sep or "://" not in rest:
        raise UserError(f"breaker key {key!r} must be TENANT@ORIGIN, e.g. acme@https://buyer.example.com")
    return tenant, rest


def cmd_breakers(args: argparse.Namespace, settings: Settings) -> int:
    from supervisor import ops

    if args.action == "reset":
        if not args.key:
            raise UserError("breakers reset needs a key: TENANT@ORIGIN (see `outboxd breakers list`)")
        tenant, origin = _breaker_key(args.key)
        found = _run_async(settings, lambda conn: ops.reset_breaker(conn, tenant, origin))
        if not found:
            raise UserError(f"no breaker {args.key}")
        print(f"breaker {args.key} reset (closed)")
        return 0
    rows = _run_async(settings, ops.list_breakers)
    if args.json:
        _print_json(rows)
    else:
        _table([(f"{r['tenant_id']}@{r['origin']}", r["state"], r["failures"], r["trips"], _iso(r["open_until"]))
                for r in rows], ["KEY", "STATE", "FAILURES", "TRIPS", "OPEN_UNTIL"])
    return 0


def cmd_keys(args: argparse.Namespace, settings: Settings) -> int:
    from supervisor.signing import ALG_ED25519, ALG_ES256, generate_signing_key_pem, load_signing_key

    if args.action == "generate":
        out = Path(args.out)
        if out.exists() and not args.overwrite:
            raise UserError(f"{out} exists; pass --overwrite to replace it")
        pem = generate_signing_key_pem(ALG_ES256 if args.alg in ("es256", ALG_ES256) else ALG_ED25519)
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(pem)
        os.chmod(out, 0o600)
        kid = args.kid or f"outboxd-{datetime.now(timezone.utc):%Y%m%d}"
        print(f"wrote {out} (mode 0600); use OUTBOX_SIGNING_KEY_FILE={out} OUTBOX_SIGNING_KEY_ID={kid}")
        return 0
    files = args.key or ([f"{settings.signing_key_file}={settings.signing_key_id or ''}"]
                         if settings.signing_key_file else [])
    files += [f"{f}={k}" for f, k in settings.tenant_signing_keys.values()]
    if not files:
        raise UserError("no key: pass --key FILE=KID or set OUTBOX_SIGNING_KEY_FILE / OUTBOX_SIGNING_KEY_ID")
    keys = []
    for spec in dict.fromkeys(files):
        path, _, kid = spec.partition("=")
        keys.append(load_signing_key(path, kid or None).public_jwk())
    print(json.dumps({"keys": keys}, indent=2))
    return 0


def cmd_purge(args: argparse.Namespace, settings: Settings) -> int:
    from outbox import store
    from outbox.db import is_postgresql
    from outbox.partitions import drop_attempt_partitions

    async def work(engine: Any) -> tuple[int, list[str]]:
        # PostgreSQL: attempt history older than the retention goes by whole partitions first
        dropped = (await drop_attempt_partitions(engine, older_than=args.older_than)
                   if is_postgresql(settings.database_url) else [])
        total = 0
        while True:  # one short transaction per batch: never a long lock on the table
            async with engine.begin() as conn:
                n = await store.purge_batch(conn, older_than=args.older_than,
                                            horizon_seconds=settings.retry_horizon_seconds, limit=args.batch)
            total += n
            if n < args.batch:
                return total, dropped

    total, dropped = _with_engine(settings, work)
    if args.json:
        _print_json({"deleted": total, "dropped_attempt_partitions": dropped})
    else:
        print(f"deleted {total} finished message(s) and their attempts; "
              f"dropped {len(dropped)} attempt partition(s) older than the retention")
    return 0


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from supervisor.demo import run_demo

    return run_demo(Path(args.dir), messages=args.messages)


def cmd_bench(args: argparse.Namespace, settings: Settings) -> int:
    from outboxd_bench import run_bench  # a tool beside the daemon: imported only when asked for

    return run_bench(settings, args)


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outboxd",
        description="Durable, signed AdCP webhook delivery from a transactional outbox. "
                    "Configured by OUTBOX_* environment variables or --config FILE.",
    )
    parser.add_argument("--config", help="TOML file with settings (the environment overrides it)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_: str, handler: Callable[..., int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(handler=handler)
        return p

    def json_flag(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="print JSON")

    def filter_flags(p: argparse.ArgumentParser, limit: int) -> None:
        p.add_argument("--state", choices=["pending", "in_flight", "delivered", "dead"])
        p.add_argument("--reason", help="dead reason: expired, conflict, signature_rejected, gone, rejected, "
                                        "invalid, blocked")
        p.add_argument("--tenant", help="tenant id")
        p.add_argument("--url", help="substring of the webhook URL")
        p.add_argument("--since", type=parse_time, help="created at or after (ISO time, or a duration ago: 2h)")
        p.add_argument("--until", type=parse_time, help="created before (ISO time, or a duration ago)")
        p.add_argument("--limit", type=int, default=limit, help=f"at most this many (default {limit})")

    p = add("migrate", "Create or upgrade the outbox tables.", cmd_migrate)
    p.add_argument("--revision", default="head", help="target revision (default head)")
    add("run", "Run the delivery daemon until SIGTERM/SIGINT.", cmd_run)
    p = add("demo", "Deliver signed webhooks end to end on SQLite to a local verifying receiver.", cmd_demo)
    p.add_argument("--dir", default="outboxd-demo", help="working directory for the demo (default ./outboxd-demo)")
    p.add_argument("--messages", type=int, default=6, help="task webhooks to send (default 6)")
    p = add("bench", "Measure throughput and latency against the configured database.", cmd_bench)
    p.add_argument("--messages", type=int, default=3000, help="messages per throughput run (default 3000)")
    p.add_argument("--rate", type=float, default=200.0, help="offered rate of the latency runs (default 200/s)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of each latency run (default 10)")
    p.add_argument("--bare-concurrency", default="1,8,32",
                   help="concurrencies of the bare httpx loop; the best is the ceiling (default 1,8,32)")
    p.add_argument("--shared-tenants", type=int, default=100,
                   help="tenants of the shared-origin case, all on one receiver origin (default 100)")
    p.add_argument("--origins", type=int, default=8, help="receiver origins of the many-origins case (default 8)")
    p.add_argument("--plain-http", action="store_true", help="run over plain HTTP instead of HTTPS")
    p.add_argument("--peer", choices=["adcp"], help="also run the adcp SDK's PgTaskWebhookOutbox (defaults) "
                                                    "against the same receiver and print the ratio")
    p.add_argument("--scale-rows", type=int, default=1_000_000, help="delivered rows for the scale check")
    json_flag(p)
    p = add("status", "Counts by state, oldest due message, open breakers, dead by reason, top backlogs.",
            cmd_status)
    p.add_argument("--top", type=int, default=5, help="tenants to show by backlog (default 5)")
    json_flag(p)
    p = add("list", "List messages.", cmd_list)
    filter_flags(p, 100)
    json_flag(p)
    p = add("show", "Show one message and every attempt.", cmd_show)
    p.add_argument("ref", metavar="ID|IDEMPOTENCY_KEY")
    json_flag(p)
    p = add("replay", "Deliver finished messages again: same bytes, same key, trigger 'replay'.", cmd_replay)
    p.add_argument("ids", nargs="*", metavar="ID", help="message ids (or use filters)")
    filter_flags(p, 1000)
    p.add_argument("--dry-run", action="store_true", help="print what would be replayed")
    p.add_argument("--force", action="store_true", help="also replay messages past their retry horizon")
    json_flag(p)
    p = add("breakers", "List circuit breakers or reset one.", cmd_breakers)
    p.add_argument("action", choices=["list", "reset"])
    p.add_argument("key", nargs="?", metavar="TENANT@ORIGIN")
    json_flag(p)
    p = add("keys", "Generate a signing key, or print the public JWKS to publish.", cmd_keys)
    p.add_argument("action", choices=["generate", "jwks"])
    p.add_argument("--alg", choices=["ed25519", "es256"], default="ed25519", help="generate: algorithm")
    p.add_argument("--out", default="outboxd-signing-key.pem", help="generate: PEM file to write (mode 0600)")
    p.add_argument("--kid", help="generate: key id to suggest")
    p.add_argument("--overwrite", action="store_true", help="generate: replace an existing file")
    p.add_argument("--key", action="append", metavar="FILE=KID", help="jwks: a key file (repeatable)")
    p = add("purge", "Delete delivered and dead history older than the retention.", cmd_purge)
    p.add_argument("--older-than", type=parse_duration, required=True, metavar="DURATION",
                   help="retention, e.g. 30d; nothing inside its retry horizon is ever deleted")
    p.add_argument("--batch", type=int, default=1000, help="rows per transaction (default 1000)")
    json_flag(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config)
        return int(args.handler(args, settings) or 0)
    except (UserError, ConfigurationError, ValueError, OSError) as exc:
        print(f"outboxd {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # database errors and the like: one line, no traceback
        from sqlalchemy.exc import SQLAlchemyError

        if isinstance(exc, SQLAlchemyError):
            detail = str(getattr(exc, "orig", None) or exc).splitlines()[0]
            print(f"outboxd {args.command}: database error: {detail}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
