"""``outboxd encryption``: keys for bodies and credentials at rest, and their rotation.

    outboxd encryption generate   print a fresh key for OUTBOX_ENCRYPTION_KEY
    outboxd encryption status     the agreed key, the rotation under way, rows per key and
                                  table, which keys can be removed; exit 1 when rows are
                                  sealed under a key this configuration lacks
    outboxd encryption reseal     move every sealed value onto the agreed key now, in batches

A rotation: generate a key; on every producer and daemon, in any order, make it
OUTBOX_ENCRYPTION_KEY and move the old one into OUTBOX_ENCRYPTION_OLD_KEYS. The new key
seals once every live process opens it; the daemons re-seal; when ``status`` says the
old key can be removed, drop it from OUTBOX_ENCRYPTION_OLD_KEYS (docs/encryption.md).
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from typing import Any

from outbox.bodies import MESSAGE_BODIES, encryption_summary, sealed_counts
from outbox.config import Settings
from outbox.keyset import read_ledger, sealer
from supervisor.cli.common import Subcommands, UserError, positive_int, print_json, run_async, with_engine


async def encryption_report(conn: Any, settings: Settings) -> dict[str, Any]:
    """Everything ``status`` says about the keys: one reading, for text and JSON alike."""
    ledger = await conn.run_sync(read_ledger)
    counts = await sealed_counts(conn)
    keys = settings.sealing()
    agreed, candidate = ledger.sealing_key_id, ledger.candidate()
    by_key: dict[str, dict[str, int]] = {}
    for table, tally in counts.items():
        for kid, n in tally.items():
            if kid is not None:
                by_key.setdefault(kid, {})[table] = n
    live = ledger.live()
    entries = []
    unopenable = 0  # sealed values under keys this process lacks
    for kid in sorted(set(by_key) | set(ledger.announced)):
        rows = by_key.get(kid, {})
        sealing_here = [r.reader_id for r in live if r.sealing_key_id == kid]
        role = ("sealing" if kid == agreed else "announced, seals once every process opens it"
                if kid == candidate else "older")
        needed = sum(rows.values())
        why = ("it is the sealing key" if kid == agreed else
               f"{needed} sealed value(s) still under it" if needed else
               f"{len(sealing_here)} live process(es) still seal under it" if sealing_here else
               "it is the key the rotation moves to" if kid == candidate else None)
        opens = keys is not None and (kid == "legacy" or keys.can_open(kid))  # legacy: tried with every key
        unopenable += 0 if opens else needed
        entries.append({"key_id": kid, "role": role, "configured": opens, "rows": rows, "removable": why is None,
                        "why_not": why})
    return {"encryption": encryption_summary(settings, agreed), "sealing_key_id": agreed,
            "rotation": None if candidate is None else {"key_id": candidate, "waiting_for": ledger.lacking(candidate)},
            "plaintext_rows": counts[MESSAGE_BODIES].get(None, 0), "keys": entries, "unopenable_rows": unopenable,
            "processes": [{"reader_id": r.reader_id, "role": r.role, "opens": sorted(r.key_ids),
                           "seals_under": r.sealing_key_id, "holding": r.unopenable} for r in live]}


def unopenable_summary(report: dict[str, Any]) -> str | None:
    """The one line that says sealed rows wait for a key this configuration lacks, with the fix."""
    missing = [e["key_id"] for e in report["keys"] if not e["configured"] and e["rows"]]
    if not report["unopenable_rows"]:
        return None
    return (f"{report['unopenable_rows']} sealed value(s) under key(s) {', '.join(missing)} that this "
            "configuration cannot open: add them to OUTBOX_ENCRYPTION_OLD_KEYS (docs/encryption.md)")


def _print_report(report: dict[str, Any]) -> None:
    print(f"encryption  {report['encryption']}")
    print(f"sealing     {report['sealing_key_id'] or 'no key agreed yet (each process seals under its own)'}")
    rotation = report["rotation"]
    if rotation is not None:
        waiting = rotation["waiting_for"]
        print(f"rotation    key {rotation['key_id']} seals once every live process opens it; "
              + (f"waiting for {', '.join(waiting)}" if waiting else "none is missing, a daemon agrees on it next"))
    print(f"plaintext   {report['plaintext_rows']} message body(ies)")
    for e in report["keys"]:
        rows = ", ".join(f"{table} {n}" for table, n in sorted(e["rows"].items())) or "no rows"
        here = "" if e["configured"] else "  NOT IN THIS CONFIGURATION"
        verdict = "can be removed: nothing needs it" if e["removable"] else f"keep it: {e['why_not']}"
        print(f"key {e['key_id']}  {e['role']}{here}  {rows}  {verdict}")
    for p in report["processes"]:
        held = f", holding {p['holding']} it cannot open" if p["holding"] else ""
        print(f"process     {p['role']} {p['reader_id']} opens {', '.join(p['opens']) or 'nothing'}, "
              f"seals under {p['seals_under'] or 'nothing'}{held}")


def cmd_encryption(args: argparse.Namespace, settings: Settings) -> int:
    if args.action == "generate":
        print(base64.b64encode(os.urandom(32)).decode())
        return 0
    if args.action == "status":
        report = run_async(settings, lambda conn: encryption_report(conn, settings), reads_only=True)
        print_json(report) if args.json else _print_report(report)
        problem = unopenable_summary(report)
        if problem is not None:
            print(problem, file=sys.stderr)
        return 1 if problem is not None else 0
    configured = settings.sealing()
    if configured is None:
        raise UserError("no OUTBOX_ENCRYPTION_KEY is set: nothing to re-seal under")
    agreed = run_async(settings, lambda conn: conn.run_sync(read_ledger), reads_only=True).sealing_key_id
    if agreed is not None and not configured.can_open(agreed):
        raise UserError(f"the agreed sealing key {agreed} is not in this configuration: add it first")
    keys = sealer(configured, agreed)
    assert keys is not None
    from supervisor.cycle.resealer import reseal_all

    count, failed = with_engine(settings, lambda engine: reseal_all(engine, keys, batch=args.batch))
    if args.json:
        print_json({"resealed": count, "unopenable": failed})
    else:
        print(f"re-sealed {count} value(s) under key {keys.active_id}")
        if failed:
            print(f"{len(failed)} row(s) do not open with this configuration (a process with their key moves "
                  f"them): {', '.join(map(str, failed[:20]))}", file=sys.stderr)
    return 1 if failed else 0


def register(add: Subcommands) -> None:
    p = add("encryption", "Encryption of bodies and credentials at rest: generate a key, status, re-seal.",
            cmd_encryption)
    p.add_argument("action", choices=["generate", "status", "reseal"])
    p.add_argument("--batch", type=positive_int, default=200, help="reseal: rows per transaction (default 200)")
    p.add_argument("--json", action="store_true", help="print JSON")
