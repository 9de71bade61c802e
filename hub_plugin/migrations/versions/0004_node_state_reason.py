"""Nodes say why they are not ``up`` (``nodes.state_reason``), and may be
``degraded``: the agent heartbeats but cannot read its GPUs (NVML failed to
start or stopped answering), so its leases go on and nothing new is placed
there. ``nodes.state`` (String(10)) already holds ``degraded``.

Existing nodes get NULL (no reason recorded).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("state_reason", sa.String(500), nullable=True))


def downgrade() -> None:
    # Without a reason a degraded node would read as an unexplained state: it is up
    # again until its agent next reports the error.
    op.execute("UPDATE nodes SET state = 'up' WHERE state = 'degraded'")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("state_reason")
