"""Worker environments: the environments each node's agent offers
(``nodes.environments``, JSON: ``[{"name", "python", "default", "usable",
"problem"}]`` as the agent reported them at registration) and the one a lease
names (``leases.env``, passed to the agent when its worker starts).

Existing rows get NULL (no environments reported; the node's default).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("environments", sa.JSON(), nullable=True))
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("env", sa.String(100), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("env")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("environments")
