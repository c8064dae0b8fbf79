"""What every ``outboxd`` subcommand module shares: argument types, printing, the database.

Kept apart from :mod:`supervisor.cli` so a subcommand module (``cli_messages``,
``cli_daemon``, ``cli_keys``, or a new one) imports these without importing the parser.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from outbox.config import Settings
from supervisor.operator.when import Ago

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class UserError(Exception):
    """A problem the user can fix: printed as one line, exit status 1."""


class UsageError(UserError):
    """A command line that asks for something impossible (argparse's kind of error): exit status 2."""


class Subcommands(Protocol):
    """The ``add`` callable :func:`supervisor.cli.build_parser` hands to each module's ``register``."""

    def __call__(self, name: str, help_: str, handler: Callable[[argparse.Namespace, Settings], int]
                 ) -> argparse.ArgumentParser: ...


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``12h``, ``30d``, ``2w`` → seconds."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30d, 12h, 15m or 90s")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_time(text: str) -> float:
    """An ISO 8601 time, or a duration meaning that long ago (``2h``, an :class:`Ago` the
    database's clock counts back from), in years 1 to 9999 in UTC: a time every listing can
    print back (``0001-01-01T00:00+14:00`` or 10**20 days ago would fail there, after the
    command had begun)."""
    try:
        when: float = Ago(parse_duration(text), time.time())
    except argparse.ArgumentTypeError:
        try:
            parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is neither an ISO 8601 time nor a duration like 2h") from None
        when = (parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)).timestamp()
    try:
        datetime.fromtimestamp(when, timezone.utc)
    except (OverflowError, ValueError, OSError):
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a time between the years 1 and 9999") from None
    return when


BIGINT_MAX = 2**63 - 1


def positive_int(text: str) -> int:
    """An argparse type for counts and sizes: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    if value > BIGINT_MAX:  # ids and counts are BIGINT in the database (SQLite: an OverflowError)
        raise argparse.ArgumentTypeError(f"must be at most {BIGINT_MAX}, got {text!r}")
    return value


def endpoint_origin_arg(text: str) -> str:
    """An argparse type for an endpoint's origin: any URL of the endpoint, reduced to the
    ``scheme://host[:port]`` the daemon records (:func:`outbox.urls.endpoint_origin`), so a
    pasted webhook URL, a trailing slash, upper case or a default port selects what it names."""
    from outbox.urls import endpoint_origin

    found = endpoint_origin(text)
    if found is None or not found.startswith(("https://", "http://")):
        raise argparse.ArgumentTypeError(f"{text!r} is not an endpoint URL like https://buyer.example.com")
    return found


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=lambda v: v.hex() if isinstance(v, bytes) else str(v)))


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> None:
    cells = [[str(c) for c in header]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def sqlite_file_problem(settings: Settings) -> str | None:
    """Why the configured SQLite database cannot be created or shared (one line), or None: an
    in-memory one lives and ends with one process, so ``migrate`` would fill one nobody else
    sees; a file in a directory that does not exist cannot be created."""
    from sqlalchemy.engine import make_url

    url = make_url(settings.database_url)
    path = url.database or ""
    if url.get_backend_name() != "sqlite":
        return None
    if path in ("", ":memory:"):
        return (f"OUTBOX_DATABASE_URL={url.render_as_string(hide_password=True)} is an in-memory SQLite database, "
                "which lives and ends with one process: the daemon, the seller and every command need the same "
                "file, e.g. sqlite:///var/lib/outboxd/outbox.db")
    if not Path(path).parent.is_dir():
        tilde = " (a ~ is not expanded: write the whole path)" if path.startswith("~") else ""
        return (f"no directory {Path(path).parent} for the SQLite file {path}{tilde}: create it first (migrate "
                "creates the file, not its directories)")
    return None


def schema_problem(settings: Settings) -> str | None:
    """Why the configured database cannot serve a command yet, as one line with the fix; or None.

    An SQLite file that does not exist is reported without opening it: connecting would
    create an empty database in the working directory.
    """
    from sqlalchemy.engine import make_url

    url = make_url(settings.database_url)
    path = url.database or ""
    if (problem := sqlite_file_problem(settings)) is not None:
        return problem
    if url.get_backend_name() == "sqlite" and not Path(path).exists():
        return (f"no outbox database at {path} (OUTBOX_DATABASE_URL={url.render_as_string(hide_password=True)}): "
                "run `outboxd migrate` to create it, or point OUTBOX_DATABASE_URL at yours")
    return None


async def _check_schema(engine: Any) -> None:
    from outbox.migrate import check_schema

    async with engine.connect() as conn:
        check = await conn.run_sync(check_schema)
    if check.verdict == "behind":
        where = "has no outbox tables" if check.database is None else f"is at schema {check.database}"
        raise UserError(f"the database {where}, this outboxd needs {check.code}: run `outboxd migrate`")
    if check.verdict == "incompatible":
        raise UserError(check.problem() or "")


def with_engine(settings: Settings, work: Callable[[Any], Any], *, reads_only: bool = False) -> Any:
    """Run ``await work(engine)`` against the configured, migrated database; the engine is
    disposed after. An unmigrated database is a one-line :class:`UserError` naming the fix.
    ``reads_only``: the work only reads (:func:`outbox.db.reading`: on SQLite it then never
    takes the write lock a seller's enqueue waits for)."""
    from outbox.db import make_async_engine, reading
    from supervisor.cycle.operator_engine import operator_engine

    problem = schema_problem(settings)
    if problem:
        raise UserError(problem)

    async def go() -> Any:
        engine = operator_engine(settings, make_async_engine)
        try:
            reader = reading(engine)
            await _check_schema(reader)
            return await work(reader if reads_only else engine)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def require_database(settings: Settings) -> None:
    """Refuse now, in one line naming the fix, a database :func:`with_engine` would refuse:
    for a command that serves the database for long, not one error per request."""

    async def nothing(engine: Any) -> None:
        return None

    with_engine(settings, nothing)


def run_async(settings: Settings, work: Callable[[Any], Any], *, reads_only: bool = False) -> Any:
    """Run ``await work(conn)`` in one transaction (``reads_only``: see :func:`with_engine`)."""

    async def in_transaction(engine: Any) -> Any:
        async with engine.begin() as conn:
            return await work(conn)

    return with_engine(settings, in_transaction, reads_only=reads_only)
