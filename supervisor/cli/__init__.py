"""``outboxd``: the daemon and the operator's tools.

Every subcommand exits 0 on success and prints a one-line error on stderr: exit 2 for a
malformed or impossible command line (argparse's convention), 1 for anything else; data-printing subcommands
take ``--json``. Each subcommand lives in a module with a ``register(add)`` function;
adding a module is one line in :data:`COMMAND_MODULES`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from outbox.config import ConfigurationWarning, Settings, load_settings
from outbox.errors import ConfigurationError
from supervisor.cli.common import UsageError, UserError
from supervisor.observe.metrics import package_version

# Each module has ``register(add)``; the subcommands appear in --help in this order.
COMMAND_MODULES = (
    "supervisor.cli.daemon",
    "supervisor.cli.messages",
    "supervisor.cli.keys",
    "supervisor.cli.encryption",
    "supervisor.cli.subscribers",
    "supervisor.cli.endpoints",
    "supervisor.cli.recover",
    "supervisor.cli.reporting",
)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line on stderr (``--help`` still shows usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="outboxd",
        description="Durable, signed AdCP webhook delivery from a transactional outbox. "
                    "Configured by OUTBOX_* environment variables or --config FILE.",
    )
    parser.add_argument("--version", action="version", version=f"outboxd {package_version()}")
    parser.add_argument("--config", help="TOML file with settings (the environment overrides it)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)

    def add(name: str, help_: str, handler: Callable[[argparse.Namespace, Settings], int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(handler=handler)
        return p

    for module in COMMAND_MODULES:
        importlib.import_module(module).register(add)
    return parser


def _warn_in_one_line(message: Any, category: type[Warning], *_: Any, **__: Any) -> None:
    print(f"outboxd: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", ConfigurationWarning)
            warnings.showwarning = _warn_in_one_line
            settings = load_settings(args.config)
        return int(args.handler(args, settings) or 0)
    except BrokenPipeError:
        # `outboxd list | head`: the reader left; say nothing, and keep Python from complaining
        # about the unflushed rest at exit. 141 is what a shell reports for a tool killed by SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except UsageError as exc:
        print(f"outboxd {args.command}: {exc} (see `outboxd {args.command} --help`)", file=sys.stderr)
        return 2
    except (UserError, ConfigurationError, ValueError, OSError) as exc:
        print(f"outboxd {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # database errors and the like: one line, no traceback
        from psycopg import Error as PsycopgError  # the adcp SDK's own pool (`outboxd reporting`)
        from sqlalchemy.exc import SQLAlchemyError

        from outbox.db import error_line

        if isinstance(exc, (SQLAlchemyError, PsycopgError)):
            print(f"outboxd {args.command}: database error: {error_line(exc)}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
