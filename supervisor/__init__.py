"""The ``outboxd`` daemon: scheduling, signing, HTTP sending, retries, breakers, metrics, CLI."""

#: Marks this ``supervisor`` as outboxd's: supervisord's PyPI package has the same import
#: name, and ``outbox.entry`` checks this before running the CLI (docs/operations.md, "Installing").
OUTBOXD_PACKAGE = True
