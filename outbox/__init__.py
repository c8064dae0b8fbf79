"""outbox: the producer side of outboxd.

A seller agent calls these inside the database transaction that moves a task to its new
state; ``outboxd`` delivers what was committed. Importing this package does not pull in the
daemon's HTTP stack.
"""

from outbox.config import Settings, load_settings
from outbox.producer import EnqueuedMessage, enqueue, enqueue_delivery_report, enqueue_task_webhook
from outbox.errors import ConfigurationError, IdempotencyConflictError, OutboxValidationError
from outbox.activity import webhook_activity
from outbox.events import enqueue_event
from outbox.subscribers import Subscriber, list_subscribers, register_subscriber, remove_subscriber

__all__ = [
    "ConfigurationError",
    "EnqueuedMessage",
    "IdempotencyConflictError",
    "OutboxValidationError",
    "Settings",
    "Subscriber",
    "enqueue",
    "enqueue_delivery_report",
    "enqueue_event",
    "enqueue_task_webhook",
    "list_subscribers",
    "load_settings",
    "register_subscriber",
    "remove_subscriber",
    "webhook_activity",
]
