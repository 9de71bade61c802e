"""Quotas, the usage ledger and the queue: the ``usage_ledger`` and
``quota_overrides`` tables, and what a queued lease must remember.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch: SQLite cannot ALTER TABLE ADD several columns in one go otherwise.
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("groups", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("model", sa.String(200), nullable=True))
        batch.add_column(sa.Column("requested_memory", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("wait_until", sa.DateTime(), nullable=True))
        batch.add_column(sa.Column("worker_memory_used", sa.BigInteger(), nullable=True))
    op.create_table(
        "usage_ledger",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("lease_id", sa.String(20), nullable=False, unique=True),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("groups", sa.JSON(), nullable=True),
        sa.Column("gpus", sa.Float(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=False),
        sa.Column("gpu_seconds", sa.Float(), nullable=False),
    )
    op.create_index("ix_usage_ledger_owner", "usage_ledger", ["owner"])
    op.create_index("ix_usage_ledger_ended_at", "usage_ledger", ["ended_at"])
    op.create_table(
        "quota_overrides",
        sa.Column("scope", sa.String(210), primary_key=True),
        sa.Column("limits", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("updated_by", sa.String(200), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("quota_overrides")
    op.drop_table("usage_ledger")
    with op.batch_alter_table("leases") as batch:
        for column in ("wait_until", "requested_memory", "model", "groups"):
            batch.drop_column(column)
