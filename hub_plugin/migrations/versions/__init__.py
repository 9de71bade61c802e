"""Alembic revisions, oldest first (see ``down_revision`` in each)."""
