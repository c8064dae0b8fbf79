"""``outboxd keys``: make a signing key, print the public JWKS to publish."""

from __future__ import annotations

import argparse
import json
import os
from datetime import datetime, timezone
from pathlib import Path

from outbox.config import Settings
from supervisor.cli_common import Subcommands, UserError


def cmd_keys(args: argparse.Namespace, settings: Settings) -> int:
    from supervisor.signing import ALG_ED25519, ALG_ES256, generate_signing_key_pem, jwks_document

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
    specs = [(path, kid or None) for path, _, kid in (spec.partition("=") for spec in args.key or ())]
    print(json.dumps(jwks_document(settings, specs), indent=2))
    return 0


def register(add: Subcommands) -> None:
    p = add("keys", "Generate a signing key, or print the public JWKS to publish.", cmd_keys)
    p.add_argument("action", choices=["generate", "jwks"])
    p.add_argument("--alg", choices=["ed25519", "es256"], default="ed25519", help="generate: algorithm")
    p.add_argument("--out", default="outboxd-signing-key.pem", help="generate: PEM file to write (mode 0600)")
    p.add_argument("--kid", help="generate: key id to suggest")
    p.add_argument("--overwrite", action="store_true", help="generate: replace an existing file")
    p.add_argument("--key", action="append", metavar="FILE=KID", help="jwks: a key file (repeatable)")
