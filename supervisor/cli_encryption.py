"""``outboxd encryption``: keys for bodies and credentials at rest, and their rotation.

    outboxd encryption generate   print a fresh key for OUTBOX_ENCRYPTION_KEY
    outboxd encryption status     which key seals, and how many rows each key (or none) holds
    outboxd encryption reseal     move every row onto the active key now, in batches

A rotation: generate a key; set it as OUTBOX_ENCRYPTION_KEY and move the old one into
OUTBOX_ENCRYPTION_OLD_KEYS, on producers and daemons; the daemons re-seal in the
background (or run ``reseal``); when ``status`` shows nothing left under the old key,
drop it from OUTBOX_ENCRYPTION_OLD_KEYS (docs/encryption.md).
"""

from __future__ import annotations

import argparse
import base64
import os
import sys

from outbox.bodies import encryption_summary, seal_counts
from outbox.config import Settings
from supervisor.cli_common import Subcommands, UserError, positive_int, print_json, run_async, with_engine


def cmd_encryption(args: argparse.Namespace, settings: Settings) -> int:
    if args.action == "generate":
        print(base64.b64encode(os.urandom(32)).decode())
        return 0
    keys = settings.sealing()
    if args.action == "status":
        counts = run_async(settings, seal_counts)
        known = set(keys.ids) if keys is not None else set()
        data = {"encryption": encryption_summary(settings),
                "active_key_id": None if keys is None else keys.active_id,
                "plaintext_rows": counts.plaintext,
                "rows_by_key": [{"key_id": kid, "rows": n, "configured": kid in known,
                                 "active": keys is not None and kid == keys.active_id}
                                for kid, n in sorted(counts.by_key.items())]}
        if args.json:
            print_json(data)
            return 0
        print(f"encryption  {data['encryption']}")
        print(f"plaintext   {counts.plaintext} row(s)")
        for item in data["rows_by_key"]:
            role = "active" if item["active"] else ("older, still opens" if item["configured"] else "NOT CONFIGURED")
            print(f"key {item['key_id']}  {item['rows']} row(s)  {role}")
        return 0
    if keys is None:
        raise UserError("no OUTBOX_ENCRYPTION_KEY is set: nothing to re-seal under")
    from supervisor.resealer import reseal_all

    count, failed = with_engine(settings, lambda engine: reseal_all(engine, keys, batch=args.batch))
    if args.json:
        print_json({"resealed": count, "unopenable": failed})
    else:
        print(f"re-sealed {count} row(s) under key {keys.active_id}")
        if failed:
            print(f"{len(failed)} row(s) do not open with any configured key (they end dead invalid when due): "
                  f"{', '.join(map(str, failed[:20]))}", file=sys.stderr)
    return 1 if failed else 0


def register(add: Subcommands) -> None:
    p = add("encryption", "Encryption of bodies and credentials at rest: generate a key, status, re-seal.",
            cmd_encryption)
    p.add_argument("action", choices=["generate", "status", "reseal"])
    p.add_argument("--batch", type=positive_int, default=200, help="reseal: rows per transaction (default 200)")
    p.add_argument("--json", action="store_true", help="print JSON")
