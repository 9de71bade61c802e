"""Each node's capacity rule as its agent reports it (``nodes.whole_gpus``:
its enforcement mode hands out whole GPUs only), instead of the service
knowing which mode names mean that.

Existing rows take it from the built-in modes that did: ``mig`` and ``exclusive``.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("whole_gpus", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.execute(sa.text("UPDATE nodes SET whole_gpus = :yes WHERE enforcement IN ('mig', 'exclusive')")
               .bindparams(yes=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("whole_gpus")
