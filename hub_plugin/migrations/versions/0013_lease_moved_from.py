"""A parked lease that resumes on another node (a cold move, ``c.PoolLeases.resume_moves``) keeps
where its state is while the move runs (``leases.moved_from``: the old node, its GPUs and host
reservation), so a failed move goes back there (docs/parking.md).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("moved_from", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("moved_from")
