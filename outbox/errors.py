"""Exceptions the producer API raises.

Every rejection of caller input is an :class:`OutboxValidationError`, a ``ValueError``
subclass, so a seller can catch bad input with the idiom it already uses, and its message
names the offending field so the fix is obvious from a log line alone.
"""

from __future__ import annotations


class OutboxValidationError(ValueError):
    """Caller input that the outbox refuses to store. Nothing was written."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class IdempotencyConflictError(OutboxValidationError):
    """The tenant's ``idempotency_key`` is already bound to another notification
    (docs/protocol.md "Idempotency").

    AdCP binds a delivery key immutably to its first payload for the whole retry horizon;
    a changed payload needs a fresh key. What counts as "changed" is defined once, in
    :func:`outbox.identity.binding_digest` (a re-rendered ``timestamp`` does not).
    """

    def __init__(self, key: str) -> None:
        super().__init__(
            "idempotency_key",
            f"{key!r} is already bound to a different payload; a changed payload needs a fresh key",
        )


class MessageNotWritten(RuntimeError):
    """The message's id was asked for, and its row was never written: the message does not
    exist. Raised as such when the transaction it was enqueued in ended where outboxd could
    not see it (a ``COMMIT`` or ``ROLLBACK`` statement sent on the driver connection itself,
    docs/enqueue.md, "When the row is written")."""

    def __init__(self, reason: str = "the transaction it was enqueued in ended outside SQLAlchemy (a COMMIT or "
                                     "ROLLBACK statement on the driver connection) before its row was sent") -> None:
        super().__init__(f"{reason}: the message does not exist")


class MessageRolledBack(MessageNotWritten):
    """The message's id was asked for after its transaction rolled back before writing it:
    the message does not exist (docs/enqueue.md, "When the row is written")."""

    def __init__(self) -> None:
        super().__init__("the message was rolled back with its transaction before it was written")


class MessageOutcomeUnknown(RuntimeError):
    """The message's id was asked for after the ``COMMIT`` its row went with got no answer (the
    connection was lost): the message exists if and only if that ``COMMIT`` took effect, which
    only the database can tell, by the message's idempotency key (docs/enqueue.md, "When the
    row is written")."""

    def __init__(self, idempotency_key: str) -> None:
        self.idempotency_key = idempotency_key
        super().__init__(f"the connection was lost before the COMMIT the message went with was answered: it exists "
                         f"if that COMMIT took effect (look up idempotency_key {idempotency_key!r})")


class ConfigurationError(ValueError):
    """A setting (environment variable or TOML key) with a value the outbox cannot use."""
