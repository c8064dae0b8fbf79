"""What makes two enqueue calls the same message, and which stream numbers a report.

Identity is ``(tenant_id, idempotency_key)``: a key string is the tenant's own, so two
tenants (or two systems of one seller) choosing the same string get two messages. A key,
once stored, is bound to one logical notification for its whole retry horizon
(docs/protocol.md, idempotency): the same notification again returns the stored record, a different one raises
:class:`IdempotencyConflictError`, and nothing is ever silently dropped.

"The same notification" is judged by :func:`binding_digest`, never by comparing body bytes,
because the rendered body carries transport-only fields: the envelope ``timestamp`` is
rendered per call, and a delivery report's ``sequence_number`` is allocated per call. A
seller retrying after an ambiguous commit with identical arguments must get its record
back, not a conflict. The digest is stored in its own column so the comparison is one
function (it can become keyed without touching the callers); rows whose digest is NULL
(plain-SQL producers, older releases) are judged by the same function over their stored
columns.

Every enqueue function stores through :func:`store_bound`, so a new one inherits all this.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from weakref import WeakKeyDictionary

from sqlalchemy import Connection, Engine, inspect, select
from sqlalchemy.dialects import postgresql, sqlite

from outbox.arguments import is_utf8
from outbox.commit_pipeline import ParkedInsert, park, parking_connection
from outbox.errors import IdempotencyConflictError, OutboxValidationError
from outbox.schema import messages
from outbox.sealing import KeyUnavailable, SealError, SealingKeys, plaintext, sealed_row
from outbox.wire import json_default

# Top-level body fields that describe the rendering, not the notification.
TRANSPORT_FIELDS = ("timestamp",)


class EnqueuedMessage:
    """What the caller gets back: enough to correlate logs, the CLI and the receiver. Immutable.

    A message whose INSERT rides the transaction's ``COMMIT`` (:mod:`outbox.commit_pipeline`)
    learns its ``id`` then; reading ``id`` before that writes the row at once.
    """

    __slots__ = ("_id", "idempotency_key", "sequence_number")
    _id: int | ParkedInsert
    idempotency_key: str
    sequence_number: int | None

    def __init__(self, id: int | ParkedInsert, idempotency_key: str, sequence_number: int | None = None) -> None:
        for name, value in (("_id", id), ("idempotency_key", idempotency_key), ("sequence_number", sequence_number)):
            object.__setattr__(self, name, value)

    @property
    def id(self) -> int:
        stored = self._id
        if isinstance(stored, ParkedInsert):
            stored = stored.id()
            object.__setattr__(self, "_id", stored)
        return stored

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"EnqueuedMessage is immutable: cannot set {name!r}")

    def _stored(self) -> int | str | None:
        """Without writing a parked row: the id if written, else why not (or ``None``: not yet)."""
        return self._id.written() if isinstance(self._id, ParkedInsert) else self._id

    def _known(self) -> tuple[object, str, int | None]:
        """What is known without writing a parked row: its id once written, else the parked row."""
        stored = self._stored()
        return (stored if isinstance(stored, int) else self._id), self.idempotency_key, self.sequence_number

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EnqueuedMessage):
            return NotImplemented
        return self._known() == other._known()

    def __hash__(self) -> int:
        return hash((self.idempotency_key, self.sequence_number))  # the same before and after the COMMIT

    def __copy__(self) -> EnqueuedMessage:
        return self  # immutable

    def __deepcopy__(self, _memo: Any) -> EnqueuedMessage:
        return self

    def __reduce__(self) -> tuple[Any, tuple[int, str, int | None]]:
        return EnqueuedMessage, (self.id, self.idempotency_key, self.sequence_number)

    def __repr__(self) -> str:
        stored = self._stored()
        if not isinstance(stored, int):
            stored = f"({stored or 'with the COMMIT'})"
        return (f"EnqueuedMessage(id={stored}, idempotency_key={self.idempotency_key!r}, "
                f"sequence_number={self.sequence_number!r})")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate object key")  # duplicate keys must be rejected (docs/protocol.md)
    return result


def decode_body(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, or ``None`` when it is not strictly one (no NaN, no dup keys).

    Shared with the daemon's integrity check, so producer and daemon judge bodies alike.
    """
    try:
        value = json.loads(body.decode("utf-8"), object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def escapes_lone_surrogate(body: bytes, decoded: Any) -> bool:
    """Whether the JSON ``body`` (``decoded`` already) escapes an unpaired surrogate
    (``"\\ud800"`` alone): Python's parser takes it, strict ones (the adcp SDK's verifier)
    refuse the body. Shared by the producer and the daemon's check of plain-SQL rows."""
    return b"\\u" in body and not is_utf8(json.dumps(decoded, ensure_ascii=False))


def binding_material(row: Mapping[str, Any], content: Mapping[str, Any] | None = None) -> bytes | None:
    """The canonical bytes of the logical notification a message row carries (``None``: body not JSON).

    Covers the destination, the auth mode, the horizon, the notification type, the stream
    and the body, minus :data:`TRANSPORT_FIELDS` and (for a numbered report) the allocated
    ``result.sequence_number``. Legacy credentials are left out on purpose: a rotated
    credential is transport, not content. JSON is canonicalized (sorted keys), so a
    plain-SQL body with another key order still matches. ``content`` is the body as a
    mapping when the caller has it (the producer's envelope, which renders to the body):
    decoding the bytes again would only cost time. Without it, ``row["body"]`` must be the
    plaintext.
    """
    body = decode_body(bytes(row["body"])) if content is None else content
    if body is None:
        return None
    body = {name: value for name, value in body.items() if name not in TRANSPORT_FIELDS}
    if row.get("sequence_key") is not None and isinstance(body.get("result"), Mapping):
        body["result"] = {name: value for name, value in body["result"].items() if name != "sequence_number"}
    material = {
        "url": row["url"], "auth_mode": row.get("auth_mode") or "rfc9421", "body": body,
        "horizon_seconds": row.get("horizon_seconds"), "notification_type": row.get("notification_type"),
        "sequence_key": row.get("sequence_key"),
    }
    return json.dumps(material, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=json_default).encode("utf-8")


def digest_under(material: bytes, kid: str | None, keys: SealingKeys | None) -> bytes:
    """The binding digest of ``material`` as a row sealed under ``kid`` stores it.

    SHA-256 for a plaintext row; for a sealed one an HMAC under its key (docs/encryption.md),
    so the database holds no plain hash of a sealed body from which a guessed token could
    be confirmed. Raises ``SealError`` when ``kid`` is not a configured key.
    """
    if kid is None:
        return hashlib.sha256(material).digest()
    if keys is None:
        raise KeyUnavailable(f"sealed under key {kid} but OUTBOX_ENCRYPTION_KEY is not set")
    return keys.digest(material, kid)


def binding_digest(row: Mapping[str, Any], keys: SealingKeys | None = None) -> bytes | None:
    """The digest a stored row (plaintext ``body``, its ``body_key_id``) is bound by."""
    material = binding_material(row)
    return None if material is None else digest_under(material, row.get("body_key_id"), keys)


_OPTIONAL = ("binding_digest", "body_key_id", "traceparent")  # columns added by 0002, 0008 and 0011
_PRESENT: WeakKeyDictionary[Engine, frozenset[str]] = WeakKeyDictionary()


def _present_columns(connection: Connection) -> frozenset[str]:
    """Which of the later migrations' columns the schema has (asked once per engine).

    The upgrade order is library first, then ``outboxd migrate``: until the migration runs,
    this release stores rows without a digest (judged by their content like any plain-SQL
    row) and bodies in plaintext. (A process started before the migration keeps doing so
    until restarted.)
    """
    known = _PRESENT.get(connection.engine)
    if known is None:
        names = {c["name"] for c in inspect(connection).get_columns(messages.name)}
        known = _PRESENT[connection.engine] = frozenset(n for n in _OPTIONAL if n in names)
    return known


_LOOKUP_COLUMNS = (messages.c.id, messages.c.tenant_id, messages.c.idempotency_key, messages.c.sequence_number,
                   messages.c.body, messages.c.url, messages.c.auth_mode, messages.c.horizon_seconds,
                   messages.c.notification_type, messages.c.sequence_key)


def seals_body(connection: Connection, keys: SealingKeys | None) -> bool:
    """Whether :func:`stored_values` seals a body on ``connection`` (a key is set, the schema has ``body_key_id``)."""
    return keys is not None and "body_key_id" in _present_columns(connection)


def _is_bound_to(row: Any, material: bytes | None, keys: SealingKeys | None, key: str) -> bool:
    """Whether the stored ``row`` carries the notification ``material`` describes.

    Compared by digest under the stored row's own key: nothing is decrypted. Only a row
    without a digest (plain SQL, an older writer: stored in plaintext) is judged from its body.
    """
    mapping = row._mapping
    kid = mapping.get("body_key_id")
    if material is None:
        return False
    try:
        if mapping.get("binding_digest") is not None:
            return hmac.compare_digest(bytes(mapping["binding_digest"]), digest_under(material, kid, keys))
        body = plaintext(SimpleNamespace(**{**mapping, "body_key_id": kid}), keys)
    except SealError as exc:
        raise OutboxValidationError("idempotency_key", f"{key!r} is bound to a message that cannot be "
                                                       f"compared here: {exc}") from None
    return binding_material({**mapping, "body": body}) == material


def bound_record(connection: Connection, tenant_id: str, key: str, material: bytes | None,
                 keys: SealingKeys | None = None) -> EnqueuedMessage | None:
    """The tenant's stored message for ``key`` if it is this notification; ``None`` if absent.

    Raises :class:`IdempotencyConflictError` when the key is bound to another notification.
    """
    present = _present_columns(connection)
    lookup = select(*_LOOKUP_COLUMNS, *(messages.c[name] for name in _OPTIONAL if name in present))
    row = connection.execute(lookup.where(messages.c.tenant_id == tenant_id, messages.c.idempotency_key == key)).first()
    if row is None:
        return None
    if not _is_bound_to(row, material, keys, key):
        raise IdempotencyConflictError(key)
    return EnqueuedMessage(row.id, key, row.sequence_number)


# No conflict target: the statement works against the pre-0002 unique index on the key
# alone as well as against (tenant_id, idempotency_key), so upgrading the library and
# migrating the database can happen in either order. Built once per dialect: constructing
# an INSERT per call cost ~0.2 ms of CPU (profiled).
_INSERTS = {
    name: dialect.insert(messages).on_conflict_do_nothing().returning(messages.c.id)
    for name, dialect in (("postgresql", postgresql), ("sqlite", sqlite))
}


# A minted key cannot be taken, so its INSERT has no conflict clause: were it taken all the
# same, the transaction fails whole rather than commit without the message.
_MINTED_INSERT = messages.insert().returning(messages.c.id)


def stored_values(connection: Connection, row: Mapping[str, Any], keys: SealingKeys | None) -> dict[str, Any]:
    """The columns to insert for a rendered row: body and credential sealed, digest taken.

    ``row`` carries the plaintext ``body``, the legacy ``credentials`` (or ``None``) and the
    binding ``material``; here they become what the schema stores. The body is sealed only
    when a key is set and the schema has ``body_key_id`` (a credential is always sealed:
    enqueue refuses one without a key).
    """
    present = _present_columns(connection)
    # Trace context is dropped on a schema one migration behind (a rolling upgrade).
    values = {k: v for k, v in row.items() if k not in ("credentials", "material")
              and (k != "traceparent" or k in present)}
    values.update(sealed_row(keys, tenant_id=row["tenant_id"], idempotency_key=row["idempotency_key"],
                             body=row["body"], credentials=row["credentials"], seal_body=seals_body(connection, keys)))
    if "binding_digest" in present and row["material"] is not None:
        values["binding_digest"] = digest_under(row["material"], values.get("body_key_id"), keys)
    return values


def insert_new(connection: Connection, row: Mapping[str, Any], keys: SealingKeys | None = None) -> int | None:
    """Insert ``row`` (see :func:`stored_values`); its id, or ``None`` when the key is already taken."""
    return connection.execute(_INSERTS[connection.dialect.name], stored_values(connection, row, keys)).scalar()


def store_bound(connection: Connection, row: Mapping[str, Any], keys: SealingKeys | None = None, *,
                minted: bool = False) -> EnqueuedMessage:
    """Insert a rendered message row or return its twin (``keys``: the settings' sealing keys).

    Insert first and look up only on conflict: the common call (a fresh key) costs one
    statement. A row whose key the enqueue ``minted`` has no twin: where the connection
    allows, its INSERT is parked to go with the transaction's next round trip, the
    ``COMMIT`` as a rule (:mod:`outbox.commit_pipeline`).
    """
    raw = parking_connection(connection) if minted else None
    if raw is not None:
        parked = park(connection, raw, _MINTED_INSERT, stored_values(connection, row, keys))
        return EnqueuedMessage(parked, row["idempotency_key"], row.get("sequence_number"))
    new_id = insert_new(connection, row, keys)
    if new_id is not None:
        return EnqueuedMessage(new_id, row["idempotency_key"], row.get("sequence_number"))
    return existing_twin(connection, row, keys)


def existing_twin(connection: Connection, row: Mapping[str, Any], keys: SealingKeys | None = None) -> EnqueuedMessage:
    """After a refused insert: the stored record if it is this notification, else a conflict."""
    found = bound_record(connection, row["tenant_id"], row["idempotency_key"], row["material"], keys)
    if found is None:  # taken, but not by this tenant: only the pre-0002 unique index does that
        raise OutboxValidationError(
            "idempotency_key", "is taken in a database not migrated to 0002_tenant_identity: run `outboxd migrate`")
    return found


def stream_key(tenant_id: str, *parts: str) -> str:
    """A sequence stream's key: tenant first, every part length-prefixed (``<len>:<part>``).

    Length-prefixing makes the encoding injective: no two (tenant, parts...) tuples share a
    key, whatever ``:`` their parts contain. PostgreSQL's ``outbox_next_sequence(tenant,
    stream)`` builds the same string for plain-SQL producers.
    """
    return "".join(f"{len(part)}:{part}" for part in (tenant_id, *parts))


def is_stream_key(text: str) -> bool:
    """Whether ``text`` is a whole :func:`stream_key` encoding (length-prefixed parts, nothing
    left over): such a text is a scoped stream's own key, never a key from before streams
    were scoped, so no stream may be seeded from a counter stored under it."""
    at = 0
    while at < len(text):
        colon = text.find(":", at)
        length = text[at:colon]
        if colon <= at or not (length.isascii() and length.isdigit()):
            return False
        at = colon + 1 + int(length)
        if at > len(text):
            return False
    return at > 0
