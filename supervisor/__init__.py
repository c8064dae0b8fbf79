"""The ``outboxd`` daemon: scheduling, signing, HTTP sending, retries, breakers, metrics, CLI."""
