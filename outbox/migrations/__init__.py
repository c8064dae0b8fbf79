"""Alembic migrations for the outbox tables, shipped inside the package.

They keep their own version table (``outbox_alembic_version``) so they run beside a
seller's own Alembic history in the same database without touching it.
"""
