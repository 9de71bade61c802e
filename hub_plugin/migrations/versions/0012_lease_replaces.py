"""A move's new lease names the lease it replaces (``leases.replaces``): the
quota does not count the old one while the move runs, and the reclaim sweep
releases an old lease its replacement has outlived (docs/api.md, POST /leases).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("replaces", sa.String(40), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("replaces")
