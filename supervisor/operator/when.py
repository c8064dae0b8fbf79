"""Times an operator gives as a duration ago (``--since 30m``), counted in the database's time.

Every time that selects messages is the database's (docs/architecture.md, "Time comes from
the database"). A duration is parsed before the database is asked, so it is kept as what it
is, and counted back from the database's clock where it is used: in the query itself, or
from the time a job's transaction reads. An operator's host clock hours off then selects what
the same command selects anywhere else (it selected nothing, or the wrong window to cancel).
"""

from __future__ import annotations

from typing import Any

from outbox.schema import db_now


class Ago(float):
    """A time given as ``seconds`` ago. As a float it is the host's clock minus ``seconds``,
    good for checking a command line (``--until`` before ``--since``) before the database is
    asked; :func:`in_sql` and :func:`at` count it back from the database's clock."""

    seconds: float

    def __new__(cls, seconds: float, host_now: float) -> Ago:
        value = super().__new__(cls, host_now - seconds)
        value.seconds = seconds
        return value


def in_sql(value: float) -> Any:
    """``value`` for a comparison in SQL: the database's now minus the duration for an
    :class:`Ago`, else the time as given."""
    return db_now() - value.seconds if isinstance(value, Ago) else value


def at(value: float | None, now: float) -> float | None:
    """``value`` in the database's time, ``now`` being the database's clock."""
    return now - value.seconds if isinstance(value, Ago) else value
