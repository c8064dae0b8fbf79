"""A delivery report's sequence number and its row, stored in one round trip on PostgreSQL.

A report's body carries its stream's next ``sequence_number`` (docs/protocol.md "Delivery
reports"), so the number must exist before the body's bytes do. The producer renders the
body once, with :data:`NUMBER_PLACEHOLDER` as the last field of ``result`` (``result`` is
the envelope's last field), so the stored bytes are always ``head + digits + b"}}"``:
:func:`with_number` writes the allocated number in without rendering again.

On PostgreSQL one statement then asks whether the key is taken, allocates the number only
when it is not, and inserts the row with the number spliced into its body: a replay
consumes no number (its stored twin is then read and judged), and a twin committed
concurrently (the insert finds the key taken) gives its number back. A sealed body is
sealed in Python, after its number is known, and SQLite runs in-process with no round trip
to save, so both take the same steps one statement at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, TextClause, bindparam, text
from sqlalchemy.dialects import postgresql

from outbox.identity import (
    EnqueuedMessage,
    bound_record,
    existing_twin,
    insert_new,
    seals_body,
    stored_values,
)
from outbox.schema import messages
from outbox.sealing import SealingKeys

# The widest number a bigint counter reaches: the body's size check sees the longest body.
NUMBER_PLACEHOLDER = 2**63 - 1
_CLOSE = b"}}"  # the end of ``result`` and of the envelope
_PLACEHOLDER_END = str(NUMBER_PLACEHOLDER).encode() + _CLOSE

# A stream continues from the counter an earlier release numbered it under (seeded on first
# use: its pre-0002 key, or the key of its URL's earlier spelling), so a buyer mid-campaign
# never sees its numbers restart at 1 after an upgrade.
SEEDS = 2  # earlier keys a stream may have been numbered under (unused ones are NULL)
_ALLOCATE = (
    "INSERT INTO outbox_sequences (stream_key, last_value) SELECT :stream_key, "
    "COALESCE((SELECT max(last_value) FROM outbox_sequences WHERE stream_key IN (:seed_0, :seed_1)), 0) + 1 {unless} "
    "ON CONFLICT (stream_key) DO UPDATE SET last_value = outbox_sequences.last_value + 1 RETURNING last_value"
)
_NEXT_SEQUENCE = text(_ALLOCATE.format(unless=""))
# Only the transaction holding the stream's row lock (it just incremented it) runs this,
# so nobody can have allocated after it: stepping back is exact and leaves no gap.
_GIVE_BACK = text(
    "UPDATE outbox_sequences SET last_value = last_value - 1 WHERE stream_key = :stream_key AND last_value = :n"
)
# Filled in by the statement itself: the body around the number and the body's digest.
_SPLICED = ("body", "body_sha256")
_PG = postgresql.dialect()


def _head(body: bytes) -> bytes:
    """What comes before the number in ``body`` (rendered with :data:`NUMBER_PLACEHOLDER` last)."""
    if not body.endswith(_PLACEHOLDER_END):
        raise ValueError("a numbered body must end with result.sequence_number (the placeholder)")
    return body[: -len(_PLACEHOLDER_END)]


def with_number(body: bytes, number: int) -> bytes:
    """``body`` (rendered with :data:`NUMBER_PLACEHOLDER` last) carrying ``number`` instead."""
    return _head(body) + str(number).encode() + _CLOSE


def _seeds(seeds: Sequence[str]) -> dict[str, str | None]:
    if len(seeds) > SEEDS:
        raise ValueError(f"a stream has at most {SEEDS} earlier keys")
    padded = [*seeds, *[None] * (SEEDS - len(seeds))]
    return {f"seed_{i}": seed for i, seed in enumerate(padded)}


def next_sequence(connection: Connection, key: str, seeds: Sequence[str]) -> int:
    """Allocate the stream's next number in the caller's transaction (row lock held to commit);
    a new stream starts after the highest counter of its ``seeds`` (earlier keys)."""
    return int(connection.execute(_NEXT_SEQUENCE, {"stream_key": key, **_seeds(seeds)}).scalar_one())


def give_back(connection: Connection, key: str, number: int) -> None:
    """Return a number this transaction allocated and will not use (no gap if it commits)."""
    connection.execute(_GIVE_BACK, {"stream_key": key, "n": number})


def store_numbered(connection: Connection, row: Mapping[str, Any], keys: SealingKeys | None, *,
                   stream: str, seeds: Sequence[str], replay: bool) -> EnqueuedMessage:
    """Store a rendered report ``row`` (body ending in the placeholder) under its stream's next number.

    ``replay``: the caller chose the key, so a stored twin may exist and is returned (or
    raises :class:`IdempotencyConflictError`) before any number is taken.
    """
    if connection.dialect.name == "postgresql" and not seals_body(connection, keys):
        stored = _in_one_statement(connection, row, keys, stream, seeds)
        if stored is not None:
            return stored
        replay = False  # the key's row was gone by the time it was read (purged): a fresh report
    if replay:
        replayed = bound_record(connection, row["tenant_id"], row["idempotency_key"], row["material"], keys)
        if replayed is not None:
            return replayed
    number = next_sequence(connection, stream, seeds)
    numbered = {**row, "body": with_number(row["body"], number), "sequence_number": number}
    new_id = insert_new(connection, numbered, keys)
    if new_id is not None:
        return EnqueuedMessage(new_id, row["idempotency_key"], number)
    give_back(connection, stream, number)  # a concurrent twin committed first: no gap
    return existing_twin(connection, numbered, keys)


def _in_one_statement(connection: Connection, row: Mapping[str, Any], keys: SealingKeys | None,
                      stream: str, seeds: Sequence[str]) -> EnqueuedMessage | None:
    """The report stored, or its stored twin; ``None`` when the key was taken but its row is gone."""
    # The body and its digest are made by the statement: no digest of the placeholder's body.
    stored = stored_values(connection, {**row, "body": b""}, keys)
    values = {name: value for name, value in stored.items() if name not in _SPLICED}
    params = {**values, "stream_key": stream, **_seeds(seeds), "head": _head(row["body"]),
              "close": _CLOSE}
    result = connection.execute(_statement(tuple(values)), params).one()
    if result.stored_id is not None:
        return EnqueuedMessage(result.stored_id, row["idempotency_key"], result.allocated)
    if result.allocated is not None:  # the insert found the key taken: a twin committed meanwhile
        give_back(connection, stream, result.allocated)
        return existing_twin(connection, row, keys)
    return bound_record(connection, row["tenant_id"], row["idempotency_key"], row["material"], keys)


@functools.lru_cache(maxsize=16)
def _statement(columns: tuple[str, ...]) -> TextClause:
    """The one statement, per set of inserted columns (a schema one migration behind has fewer)."""
    quote = _PG.identifier_preparer.quote
    casts = ", ".join(f"CAST(:{name} AS {messages.c[name].type.compile(_PG)})" for name in columns)
    sql = f"""
        WITH taken AS MATERIALIZED (
            SELECT 1 FROM outbox_messages WHERE tenant_id = :tenant_id AND idempotency_key = :idempotency_key
        ),
        allocated AS ({_ALLOCATE.format(unless="WHERE NOT EXISTS (SELECT 1 FROM taken)")}),
        rendered AS (
            SELECT last_value AS n, :head || convert_to(CAST(last_value AS text), 'UTF8') || :close AS body
            FROM allocated
        ),
        stored AS (
            INSERT INTO outbox_messages ({", ".join(quote(name) for name in columns)}, sequence_number, body,
                                         body_sha256)
            SELECT {casts}, r.n, r.body, sha256(r.body) FROM rendered AS r
            ON CONFLICT DO NOTHING RETURNING id
        )
        SELECT (SELECT n FROM rendered) AS allocated, (SELECT id FROM stored) AS stored_id"""
    return text(sql).bindparams(
        *(bindparam(name, type_=messages.c[name].type) for name in columns),
        bindparam("head", type_=messages.c.body.type), bindparam("close", type_=messages.c.body.type))
