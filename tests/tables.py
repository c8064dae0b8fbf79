"""The outbox's tables as the tests treat them between tests: emptied, or kept as migrated.

``tests/conftest.py`` empties the first list before each test; ``tests/test_migrate.py``
fails when a migration adds a table that is in neither list.
"""

from __future__ import annotations

from outbox.claim_sql import DUE_TABLES

# Every table a test may write, in an order that empties them all: outbox_breakers' delete
# trigger records an arrival, so the due tables come after it.
EMPTIED_TABLES = ("outbox_messages", "outbox_attempts", "outbox_sequences", "outbox_breakers",
                  "outbox_breaker_transitions", "outbox_signing_keys", "outbox_subscribers", "outbox_encryption_keys",
                  "outbox_encryption_readers", "outbox_endpoint_stats", "outbox_operator_events", "outbox_jobs",
                  "outbox_job_items", *DUE_TABLES)
# Kept as the migrations leave them: the keyring's one version row, the schema's compatibility
# rows and its revision (tests/test_migrate.py checks that every table is in one list or the other).
KEPT_TABLES = ("outbox_keyring", "outbox_schema_compat", "outbox_alembic_version")
