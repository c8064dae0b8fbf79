"""Start the console: pick the token, bind ``OUTBOX_UI_ADDR`` (loopback by default), serve."""

from __future__ import annotations

import ipaddress
import secrets
import sys

from outbox.config import Settings, parse_addr

MIN_REMOTE_TOKEN = 32  # characters; what ``secrets.token_urlsafe(24)`` makes


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(settings: Settings) -> int:
    """Run the console until SIGINT/SIGTERM; the token is printed only when generated here."""
    try:
        import uvicorn

        from supervisor.ui.app import make_app
    except ImportError as exc:
        raise ValueError(f"the console needs the [ui] extra (pip install 'outboxd[ui]'): {exc}") from None
    host, port = parse_addr(settings.ui_addr, "OUTBOX_UI_ADDR", lowest_port=1)
    if not _is_loopback(host) and settings.ui_token is not None and len(settings.ui_token) < MIN_REMOTE_TOKEN:
        # Off loopback the token is all that stands between the network and replay or reset.
        raise ValueError(f"OUTBOX_UI_TOKEN has {len(settings.ui_token)} characters: a console listening on {host} "
                         f"needs at least {MIN_REMOTE_TOKEN} (make one with: openssl rand -base64 32)")
    token = settings.ui_token or secrets.token_urlsafe(24)
    print(f"outboxd ui: http://{host}:{port}/ ", file=sys.stderr, end="")
    print("(sign in with OUTBOX_UI_TOKEN)" if settings.ui_token else f"(sign in with token {token})",
          file=sys.stderr, flush=True)
    if not _is_loopback(host):
        print(f"outboxd ui: warning: listening on {host}, not loopback: put TLS in front of it", file=sys.stderr)
    # A page still waiting when told to stop gets the shutdown grace, as the daemon's requests do.
    uvicorn.run(make_app(settings, token), host=host, port=port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=settings.shutdown_grace_seconds)
    return 0
