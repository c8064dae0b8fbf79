"""structlog set-up: JSON lines by default, readable on a terminal.

Events carry ids, keys and outcomes only. Secrets never reach a log call in the first
place; as a second line of defence a processor strips userinfo, query and fragment from
every URL in any string field.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog
import structlog.tracebacks

from outbox.urls import redact_urls


def _strip_query(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    for name, value in event.items():
        if isinstance(value, str) and "://" in value:  # url, origin, sequence_key, error text
            event[name] = redact_urls(value)
    return event


_TRACEBACKS = structlog.processors.ExceptionRenderer(structlog.tracebacks.ExceptionDictTransformer(show_locals=False))


def configure_logging(fmt: str = "auto", level: int = logging.INFO) -> None:
    """``fmt``: ``json``, ``console``, or ``auto`` (console when stderr is a TTY)."""
    console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    # The console renderer prints ``exc_info`` itself; JSON needs it turned into data first,
    # or ``log.exception`` writes ``"exc_info": true`` and the stack is lost. Never with
    # frame locals: they hold decrypted credentials and buyer URLs.
    renderers: list[Any] = (
        [structlog.dev.ConsoleRenderer()]
        if console
        else [_TRACEBACKS, structlog.processors.JSONRenderer()]
    )
    shared: list[Any] = [structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True),
                         _strip_query]
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, *shared, *renderers],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    # What libraries log through the standard library (psycopg's "query not terminated after
    # cancellation", asyncio's unretrieved task errors) comes out in the same format, one
    # JSON object a line, named by its logger, instead of raw text in a JSON stream.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderers]))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(max(level, logging.WARNING))
