"""Start the console: pick the token, bind ``OUTBOX_UI_ADDR`` (loopback by default), serve."""

from __future__ import annotations

import ipaddress
import os
import secrets
import signal
import socket
import sys

from outbox.config import Settings
from outbox.config_values import parse_addr

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
    _stop_signals_end_quietly()  # before the port accepts: a stop from then on ends it with status 0
    listening = _listen(host, port)  # before anything is printed: a port in use is one line, no token shown
    token = settings.ui_token or secrets.token_urlsafe(24)
    shown = f"[{host}]" if ":" in host else host
    print(f"outboxd ui: http://{shown}:{port}/ ", file=sys.stderr, end="")
    print("(sign in with OUTBOX_UI_TOKEN)" if settings.ui_token else f"(sign in with token {token})",
          file=sys.stderr, flush=True)
    if not _is_loopback(host):
        print(f"outboxd ui: warning: listening on {host}, not loopback: put TLS in front of it", file=sys.stderr)
    # A page still waiting when told to stop gets the shutdown grace, as the daemon's requests do.
    config = uvicorn.Config(make_app(settings, token), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=settings.shutdown_grace_seconds)  # type: ignore[arg-type]
    uvicorn.Server(config).run(sockets=[listening])
    return 0


def _stop_signals_end_quietly() -> None:
    """uvicorn sends itself the stop signal again after its graceful shutdown, which under the
    default handlers ends the process by that signal (status 143, or a traceback for SIGINT); a
    supervisor reads that as a failed stop. These handlers end the process with status 0
    instead, as the daemon's graceful stop does: the re-sent signal after uvicorn's shutdown,
    and a signal that comes before uvicorn has taken them over (the console starting, nothing
    to drain yet). SIGHUP stops it as SIGTERM does."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_now)
    # A closed terminal stops it as SIGTERM does (uvicorn itself handles only SIGTERM and SIGINT).
    signal.signal(signal.SIGHUP, lambda _sig, _frame: signal.raise_signal(signal.SIGTERM))


def _exit_now(_sig: int, _frame: object) -> None:
    """End the process with status 0 at once. Not by raising ``SystemExit``: a handler's
    exception lands wherever the main thread is, and inside a weakref callback or a
    ``__del__`` Python prints it and goes on (seen: a stop while the console started was
    swallowed so, and the console served on)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def _listen(host: str, port: int) -> socket.socket:
    """The console's listening socket, or one line naming OUTBOX_UI_ADDR and why it cannot be
    (a port in use, an address not on this host, a name that does not resolve)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listening = socket.socket(family, socket.SOCK_STREAM)
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind((host, port))
        listening.listen(2048)
    except OSError as exc:
        raise ValueError(f"OUTBOX_UI_ADDR {host}:{port}: cannot listen there ({exc.strerror or exc})") from None
    listening.set_inheritable(True)
    return listening
