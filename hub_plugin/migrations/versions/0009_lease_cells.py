"""Each lease's cell activity (``lease_cells``: one row per cell its worker
ran, from the agent's heartbeats) and, on ``leases``, the last cell's start,
whether it is still open, and whether its cells are recorded at all (false
for the leases already there), so that ``gpupool simulate --from-store``
replays the cells that ran instead of one busy burst per lease.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("cell_started_at", sa.DateTime(), nullable=True))
        batch.add_column(sa.Column("cell_open", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("cells_recorded", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.create_table(
        "lease_cells",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("lease_id", sa.String(20), sa.ForeignKey("leases.id", ondelete="CASCADE"), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
    )
    op.create_index("ix_lease_cells_lease_id", "lease_cells", ["lease_id"])


def downgrade() -> None:
    op.drop_index("ix_lease_cells_lease_id", table_name="lease_cells")
    op.drop_table("lease_cells")
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("cells_recorded")
        batch.drop_column("cell_open")
        batch.drop_column("cell_started_at")
