"""outbox: the producer side of outboxd.

A seller agent calls these inside the database transaction that moves a task to its new
state; ``outboxd`` delivers what was committed. Importing this package does not pull in the
daemon's HTTP stack.
"""

from outbox.config import Settings, load_settings
from outbox.producer import EnqueuedMessage, enqueue, enqueue_delivery_report, enqueue_task_webhook
from outbox.errors import ConfigurationError, IdempotencyConflictError, OutboxValidationError

__all__ = [
    "ConfigurationError",
    "EnqueuedMessage",
    "IdempotencyConflictError",
    "OutboxValidationError",
    "Settings",
    "enqueue",
    "enqueue_delivery_report",
    "enqueue_task_webhook",
    "load_settings",
]
