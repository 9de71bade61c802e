"""A resume asked ahead of a cell (the JupyterLab extension's, when the user is back at the
notebook) waits for the lease's own node and never moves it (``leases.resume_in_place``): a move
loses what cannot be saved to disk, which only a cell that needs the worker may cost
(docs/parking.md).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("resume_in_place", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("resume_in_place")
