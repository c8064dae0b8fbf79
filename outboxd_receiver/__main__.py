"""``python -m outboxd_receiver [--jwks FILE | --jwks-url URL...] [--port-file FILE] [--log FILE]
[--tls-cert PEM --tls-key PEM] [--listen N]``

With ``--listen N`` one process serves N ports (N receiver origins, as many buyers on
distinct hosts would be); the port file then holds the N ports separated by spaces.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import sys
from pathlib import Path

from outboxd_receiver.server import Receiver, serve
from outboxd_receiver.verifiers import adcp_verifier, library_verifier, served_jwks_verifier


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m outboxd_receiver", description=__doc__)
    parser.add_argument("--jwks", help="public JWKS to verify signatures with (omit: no verification)")
    parser.add_argument("--jwks-url", action="append",
                        help="verify with the adcp SDK against the JWKS served here now (repeatable: round robin)")
    parser.add_argument("--revocation-url", help="with --jwks-url: also check this signed revocation list")
    parser.add_argument("--revocation-issuer", help="the revocation list's expected issuer origin")
    parser.add_argument("--verifier", choices=["library", "adcp"], default="library")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--listen", type=int, default=1, help="how many ports (origins) to serve")
    parser.add_argument("--port-file", help="write the bound port(s) here once listening")
    parser.add_argument("--log", help="append one JSON line per arrival here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-bodies", action="store_true", help="also log each body and Authorization header")
    parser.add_argument("--tls-cert", help="serve HTTPS with this certificate chain (PEM)")
    parser.add_argument("--tls-key", help="the certificate's private key (PEM)")
    args = parser.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.listen < 1 or (args.port and args.listen > 1):
        parser.error("--listen must be at least 1, and 1 with a fixed --port")
    verifier = None
    if args.jwks_url:
        verifier = served_jwks_verifier(args.jwks_url, args.revocation_url, args.revocation_issuer)
    elif args.jwks:
        jwks = json.loads(Path(args.jwks).read_text())
        verifier = (adcp_verifier if args.verifier == "adcp" else library_verifier)(jwks)
    context = None
    if args.tls_cert:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(args.tls_cert, args.tls_key)
    log = open(args.log, "a") if args.log else None

    async def run() -> None:
        receiver = Receiver(verifier, log, seed=args.seed, scheme="https" if context else "http",
                            log_bodies=args.log_bodies)
        servers = [await serve(receiver, args.port, context) for _ in range(args.listen)]
        ports = " ".join(str(s.sockets[0].getsockname()[1]) for s in servers)
        if args.port_file:
            tmp = Path(args.port_file + ".tmp")
            tmp.write_text(ports)
            tmp.rename(args.port_file)
        print(ports, flush=True)
        await asyncio.gather(*(s.serve_forever() for s in servers))

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
