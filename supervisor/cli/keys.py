"""``outboxd keys``: the keyring from the operator's side (generate, rotate, promote, revoke, list).

Every change goes through ``supervisor.keys.keyring``, which enforces the waits; refusals are
one-line ``KeyringError``s (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from outbox.config import Settings
from outbox.errors import ConfigurationError
from supervisor.cli.common import Subcommands, print_json, run_async, table
from supervisor.keys import keyring
from supervisor.keys.keyring import DEFAULT_SCOPE, Snapshot, iso, scope_label
from supervisor.wire.signing import (
    ADCP_USE_REQUEST,
    ADCP_USE_WEBHOOK,
    ALG_ED25519,
    ALG_ES256,
    DEFAULT_ADCP_USE,
    SigningKey,
    generate_signing_key_pem,
    load_signing_key,
    readable_by_others,
)


def _warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr)


def _in_transaction(settings: Settings, work: Callable[[Any], Any]) -> Any:
    """``work(sync connection)`` in one transaction, after seeding an empty keyring from the
    configured key files (so keys staged before the daemon's first start do not hide it)."""
    def seeded(conn: Any) -> Any:
        keyring.bootstrap(conn, settings)
        return work(conn)

    return run_async(settings, lambda conn: conn.run_sync(seeded))


def _read_snapshot(settings: Settings) -> Snapshot:
    """The keyring as a reader sees it, seeded first only when a configured key is not in it yet:
    reading takes no write lock, so on SQLite it neither waits behind a seller's transaction nor
    holds up the seller's next enqueue."""
    snapshot: Snapshot = run_async(settings, lambda conn: conn.run_sync(keyring.read_snapshot), reads_only=True)
    if keyring.unseeded(snapshot, keyring.configured_keys(settings)):
        return _in_transaction(settings, keyring.read_snapshot)
    return snapshot


def write_private_key(out: Path, alg: str, overwrite: bool = False) -> None:
    """A fresh PEM private key at ``out``, mode 0600, refusing to replace a file by accident."""
    if out.exists() and not overwrite:
        raise ConfigurationError(f"{out} exists; pass --overwrite to replace it")
    pem = generate_signing_key_pem(ALG_ES256 if alg in ("es256", ALG_ES256) else ALG_ED25519)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
    os.chmod(out, 0o600)


def _default_kid(scope: str) -> str:
    return f"{scope or 'outboxd'}-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"


def _load_for_staging(path: Path, kid: str | None, scope: str) -> SigningKey:
    """The key in ``path``; a JWK keeps its own ``kid`` unless one is given, a PEM gets one."""
    try:
        is_jwk = path.read_bytes().lstrip().startswith(b"{")
    except OSError as exc:
        raise ConfigurationError(f"signing key file {path}: cannot read it ({exc.strerror})") from None
    key = load_signing_key(path, kid or (None if is_jwk else _default_kid(scope)))
    if readable_by_others(path):
        _warn(f"{path} is readable by every user of this host: chmod 600 {path}")
    return key


def _iso(epoch: float | None) -> str:
    return "-" if epoch is None else iso(epoch)


def _print_keys(snapshot: Snapshot, scope: str | None, settings: Settings) -> None:
    now = snapshot.now
    rows = []
    for r in sorted(snapshot.records, key=lambda r: (r.scope, r.published_at, r.kid)):
        if scope is not None and r.scope != scope:
            continue
        promotable = r.published_at + settings.key_cache_window_seconds if r.state(now) == "next" else None
        rows.append((r.kid, r.scope or "(default)", r.state(now), r.alg, r.adcp_use, _iso(r.published_at),
                     _iso(promotable), _iso(r.activates_at), _iso(r.deactivates_at), _iso(r.unpublish_at),
                     _iso(r.revoked_at), r.key_file))
    table(rows, ["KID", "SCOPE", "STATE", "ALG", "ADCP_USE", "PUBLISHED", "PROMOTABLE", "ACTIVE_FROM",
                  "ACTIVE_UNTIL", "UNPUBLISHED", "REVOKED", "FILE"])


def _rotate(args: argparse.Namespace, settings: Settings, scope: str) -> dict[str, Any]:
    path = Path(args.generate or args.key_file).absolute()
    if args.generate:
        write_private_key(path, args.alg)
    key = _load_for_staging(path, args.kid, scope)
    if args.adcp_use == ADCP_USE_REQUEST:
        _warn(f"buyers on AdCP 3.0 verifiers (the TypeScript @adcp/sdk 6.x among them) reject webhooks signed by a "
              f"{ADCP_USE_REQUEST!r} key (webhook_mode_mismatch); {ADCP_USE_WEBHOOK!r} verifies for every buyer")
    record = _in_transaction(settings, lambda c: keyring.stage(c, scope=scope, key=key, key_file=str(path),
                                                               adcp_use=args.adcp_use))
    ready = record.published_at + settings.key_cache_window_seconds
    return {"staged": record.kid, "scope": scope, "state": "next", "key_file": str(path),
            "promotable_at": iso(ready),
            "message": f"staged {record.kid} for {scope_label(scope)} as next (published, not signing); "
                       f"promote it after {iso(ready)} with `outboxd keys promote{keyring.tenant_flag(scope)}`"}


def _promote(args: argparse.Namespace, settings: Settings, scope: str) -> dict[str, Any]:
    done = _in_transaction(settings, lambda c: keyring.promote(
        c, scope=scope, kid=args.kid, cache_window=settings.key_cache_window_seconds, force=args.force))
    if done.forced_early:
        _warn(f"{done.new.kid} was published less than {settings.key_cache_window_seconds:.0f} s ago: buyers whose "
              "cached JWKS predates it reject its webhooks (webhook_signature_key_unknown) until they refetch")
    old = (f"; {done.old.kid} retires (published until {iso(done.old.unpublish_at or 0)})" if done.old else "")
    return {"promoted": done.new.kid, "scope": done.new.scope, "signs_from": iso(done.switch_at),
            "retiring": done.old.kid if done.old else None, "forced": done.forced_early,
            "message": f"promoted {done.new.kid}: every daemon signs {scope_label(done.new.scope)} with it from "
                       f"{iso(done.switch_at)}{old}"}


def _revoke(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    def work(conn: Any) -> tuple[Any, Snapshot]:
        record = keyring.revoke(conn, args.kid)
        return record, keyring.read_snapshot(conn)

    record, snapshot = _in_transaction(settings, work)
    paused = snapshot.paused(snapshot.now).get(record.scope)
    if paused is not None:  # the line `outboxd status` and /readyz give, with the same fix
        _warn(paused)
    if settings.revocation_issuer is None:
        _warn("OUTBOX_REVOCATION_ISSUER is not set, so no signed revocation list is served: buyers stop "
              f"trusting {record.kid} only once their cached JWKS expires")
    return {"revoked": record.kid, "scope": record.scope,
            "message": f"revoked {record.kid}: no longer signs nor published; listed in revoked_kids"}


def _revocations(snapshot: Snapshot, settings: Settings) -> dict[str, Any]:
    from supervisor.keys.keyring_cache import load_private_key

    if settings.revocation_issuer is None:
        raise ConfigurationError("set OUTBOX_REVOCATION_ISSUER to your brand.json origin (the list's issuer)")
    signer = snapshot.signer(snapshot.now)
    if signer is None:
        raise ConfigurationError("no active key to sign the revocation list with")
    return keyring.revocation_document(snapshot.records, snapshot.now, issuer=settings.revocation_issuer,
                                       signer=load_private_key(signer))


def cmd_keys(args: argparse.Namespace, settings: Settings) -> int:
    scope = args.tenant if getattr(args, "tenant", None) else DEFAULT_SCOPE
    if args.action == "generate":
        write_private_key(Path(args.out), args.alg, args.overwrite)
        kid = args.kid or _default_kid(DEFAULT_SCOPE)
        print(f"wrote {args.out} (mode 0600); use OUTBOX_SIGNING_KEY_FILE={args.out} OUTBOX_SIGNING_KEY_ID={kid}, "
              f"or stage it with `outboxd keys rotate --key-file {args.out}`; it is published with "
              f"adcp_use {DEFAULT_ADCP_USE}")
        return 0
    if args.action in ("list", "jwks", "revocations"):
        snapshot = _read_snapshot(settings)
        if args.action == "jwks":
            document = keyring.jwks_document(snapshot.records, snapshot.now)
            print(json.dumps(document, indent=2))
            if not document["keys"]:  # publishing it would make every signature unverifiable
                print("outboxd keys: warning: the keyring has no published key yet: `outboxd run` registers "
                      "OUTBOX_SIGNING_KEY_FILE's at its first start (or `outboxd keys rotate --key-file FILE`)",
                      file=sys.stderr)
        elif args.action == "revocations":
            print(json.dumps(_revocations(snapshot, settings), indent=2))
        elif args.json:
            print_json([r.as_dict(snapshot.now) for r in snapshot.records if args.tenant is None
                         or r.scope == scope])
        else:
            _print_keys(snapshot, None if args.tenant is None else scope, settings)
        return 0
    result = {"rotate": lambda: _rotate(args, settings, scope), "promote": lambda: _promote(args, settings, scope),
              "revoke": lambda: _revoke(args, settings)}[args.action]()
    if args.json:
        print_json({k: v for k, v in result.items() if k != "message"})
    else:
        print(result["message"])
    return 0


def register(add: Subcommands) -> None:
    """Add ``outboxd keys ...`` to the CLI's subcommands."""
    keys = add("keys", "The signing keyring: generate, rotate, promote, revoke, list keys, print the JWKS.",
               cmd_keys)
    actions = keys.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name: str, help_: str, *, tenant: bool = False, json_: bool = False) -> argparse.ArgumentParser:
        p = actions.add_parser(name, help=help_, description=help_)
        if tenant:
            p.add_argument("--tenant", help="the tenant's own scope (default: the default scope)")
        if json_:
            p.add_argument("--json", action="store_true", help="print JSON")
        return p

    p = action("generate", "Write a new private key (PEM, mode 0600).")
    p.add_argument("--alg", choices=["ed25519", "es256"], default="ed25519")
    p.add_argument("--out", default="outboxd-signing-key.pem", help="PEM file to write")
    p.add_argument("--kid", help="key id to suggest")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file")
    action("list", "Every key with its scope, state and dates.", tenant=True, json_=True)
    p = action("rotate", "Stage a new key as next: published now, signing once promoted.", tenant=True, json_=True)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--key-file", help="an existing PEM or private JWK file (the daemons read it there)")
    source.add_argument("--generate", metavar="PATH", help="write a new private key here and stage it")
    p.add_argument("--alg", choices=["ed25519", "es256"], default="ed25519", help="with --generate")
    p.add_argument("--kid", help="key id (default: the JWK's kid, or SCOPE-<UTC time>)")
    p.add_argument("--adcp-use", choices=[ADCP_USE_WEBHOOK, ADCP_USE_REQUEST], default=DEFAULT_ADCP_USE,
                   help=f"JWK purpose (default {DEFAULT_ADCP_USE}, which AdCP 3.0 and 3.1+ buyers verify; "
                        f"{ADCP_USE_REQUEST} only 3.1+ buyers)")
    p = action("promote", "Make the next key active (refused within the buyer cache window).", tenant=True,
               json_=True)
    p.add_argument("kid", nargs="?", help="the next key to promote (default: the scope's only next key)")
    p.add_argument("--force", action="store_true", help="promote before the cache window has passed")
    p = action("revoke", "Stop signing with and publishing a key now; list it as revoked.", json_=True)
    p.add_argument("kid")
    action("jwks", "Print the JWKS (every scope's published keys) to serve at your jwks_uri.")
    action("revocations", "Print the signed revocation list (needs OUTBOX_REVOCATION_ISSUER).")
