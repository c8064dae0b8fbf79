"""``outboxd migrate | run | config | ui | demo | bench``: running outboxd and its schema."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from outbox.config import Settings
from supervisor.cli.common import (Subcommands, UserError, positive_int, require_database, schema_problem,
                                   sqlite_file_problem)


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from outbox.db import make_engine
    from outbox.migrate import head_revision, upgrade
    from supervisor.cycle.operator_engine import operator_engine

    problem = sqlite_file_problem(settings)  # a missing file is what migrate creates
    if problem:
        raise UserError(problem)
    before, after = upgrade(operator_engine(settings, make_engine), args.revision)
    if before != after:
        print(f"outbox schema: {before or 'empty'} -> {after}")
    elif args.revision == "head" and after != head_revision():
        print(f"outbox schema: at {after}, newer than this release ({head_revision()}); nothing to do")
    else:
        print(f"outbox schema: at {after}")
    return 0


def _leave(code: int, message: str | None = None) -> NoReturn:
    """Exit now, without closing the event loop or Python's teardown of the interpreter.

    By then the daemon has closed everything it opened (connections, sinks, the hand-off's
    pools, the metrics endpoint) and flushed what it logged. What is left would only take
    time from the grace the manifests allow (docs/operations.md, "Stopping"): closing the
    loop joins its executor's threads, one of which may still be importing a seller's SDK
    for the reporting hand-off (ten seconds and more) or waiting on the seller's own
    database connection, and the teardown collects the objects of a process about to end
    (with the SDK imported, 2-5 s). Handlers registered with :mod:`atexit` do not run."""
    if message is not None:
        print(message, file=sys.stderr)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def cmd_run(args: argparse.Namespace, settings: Settings) -> NoReturn:
    from supervisor.cycle.daemon import Daemon, event_loop_factory
    from supervisor.observe.logs import configure_logging
    from supervisor.cycle.outage import DatabaseUnavailable

    # A missing SQLite file is refused, not created empty to wait on (docs/operations.md); an
    # unmigrated database is waited for, as a daemon started before `outboxd migrate` must.
    problem = schema_problem(settings)
    if problem:
        raise UserError(problem)
    configure_logging(settings.log_format)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        try:
            runner.run(Daemon(settings).run())
        except DatabaseUnavailable as exc:
            _leave(1, f"outboxd run: {exc}")
        _leave(0)  # before the runner closes the loop, which would join the loop's threads


def _toml_value(value: object) -> str:
    return json.dumps(value)  # TOML's basic strings, numbers, booleans and arrays read the same


def cmd_config(args: argparse.Namespace, settings: Settings) -> int:
    from outbox.config import effective

    shown = effective(settings)
    if args.json:
        print(json.dumps(shown, indent=2))
        return 0
    print("[outbox]")
    for name, value in shown.items():
        if value is None:
            print(f"# {name} is not set")
        elif name != "tenant_signing_keys":
            print(f"{name} = {_toml_value(value)}")
    for tenant, entry in shown["tenant_signing_keys"].items():
        print(f"\n[outbox.tenant_signing_keys.{_toml_value(tenant)}]")
        print(f"file = {_toml_value(entry['file'])}\nkey_id = {_toml_value(entry['key_id'])}")
    return 0


def cmd_ui(args: argparse.Namespace, settings: Settings) -> int:
    from supervisor.ui.server import serve

    require_database(settings)  # once at start, not a 503 on every page (docs/operations.md)
    return serve(settings)


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from supervisor.cli.demo import run_demo

    return run_demo(Path(args.dir), messages=args.messages)


def cmd_bench(args: argparse.Namespace, settings: Settings) -> int:
    from outboxd_bench import run_bench  # a tool beside the daemon: imported only when asked for

    return run_bench(settings, args)


def register(add: Subcommands) -> None:
    p = add("migrate", "Create or upgrade the outbox tables.", cmd_migrate)
    p.add_argument("--revision", default="head", help="target revision (default head)")
    add("run", "Run the delivery daemon until SIGTERM/SIGINT.", cmd_run)
    p = add("config", "Print the effective configuration (file, then OUTBOX_* variables), secrets masked.",
            cmd_config)
    p.add_argument("--json", action="store_true", help="print JSON")
    add("ui", "Serve the web console (OUTBOX_UI_ADDR, loopback by default; sign in with OUTBOX_UI_TOKEN).",
        cmd_ui)
    p = add("demo", "Deliver signed webhooks end to end on SQLite to a local verifying receiver.", cmd_demo)
    p.add_argument("--dir", default="outboxd-demo", help="working directory for the demo (default ./outboxd-demo)")
    p.add_argument("--messages", type=positive_int, default=6, help="task webhooks to send (default 6)")
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
    p.add_argument("--endpoints", type=int, default=10_000,
                   help="backlogged endpoints of the many-endpoints phase (compared with 10)")
    p.add_argument("--recovery-messages", type=int, default=10_000,
                   help="dead messages the recovery phase's replay job takes while live traffic runs (default 10000)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--only", default="", metavar="PHASE[,PHASE]",
                   help="run only these phases (names as in the JSON's phases, e.g. bare_c8,throughput_one_origin); "
                        "the table's ratios need the phases they compare")
