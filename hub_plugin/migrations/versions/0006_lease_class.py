"""Lease classes: ``leases.lease_class`` (``interactive`` or
``batch``; the queue places interactive requests first) and
``leases.preemptible`` (the lease opted in to having its running cell
interrupted and being parked while others wait).

Existing rows become ``interactive`` and not preemptible, what they were.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("lease_class", sa.String(12), nullable=False, server_default="interactive"))
        batch.add_column(sa.Column("preemptible", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("preemptible")
        batch.drop_column("lease_class")
