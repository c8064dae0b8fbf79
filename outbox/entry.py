"""The ``outboxd`` console script: make sure ``supervisor`` is outboxd's, then run its CLI.

The daemon lives in the top-level package ``supervisor``, which is also the import name of
supervisord's PyPI distribution (also called ``supervisor``). With both in one environment,
or a supervisord checkout earlier on ``sys.path``, Python imports whichever comes first and
the other breaks with a confusing ``No module named 'supervisor.cli'``. This entry point
lives in ``outbox`` (a name nobody else claims) so it can say what is wrong in one line.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from outbox.errors import ConfigurationError


def require_outboxd_supervisor() -> ModuleType:
    """Import ``supervisor`` and prove it is outboxd's, or raise a one-line error saying why."""
    try:
        package = importlib.import_module("supervisor")
    except ImportError:
        raise ConfigurationError("the package 'supervisor' (outboxd's daemon) is not importable: "
                                 "reinstall outboxd") from None
    if getattr(package, "OUTBOXD_PACKAGE", False) is not True:
        where = getattr(package, "__file__", None) or ", ".join(getattr(package, "__path__", [])) or "?"
        raise ConfigurationError(
            f"the package 'supervisor' imported from {where} is not outboxd's (supervisord's PyPI package "
            "'supervisor' has the same import name): uninstall it from this environment, or install outboxd "
            "in a virtualenv of its own"
        )
    return package


def main(argv: Sequence[str] | None = None) -> int:
    """``outboxd ...``: the daemon's CLI, after the ``supervisor`` package check."""
    try:
        require_outboxd_supervisor()
    except ConfigurationError as exc:
        print(f"outboxd: {exc}", file=sys.stderr)
        return 1
    from supervisor.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
