"""Leases remember the JupyterHub server they came from (``leases.server_name``),
so the hub's ``post_stop_hook`` releases only a stopped server's leases.

Existing leases get NULL (unknown server): they are released when the
user's last server stops, as before this revision.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("server_name", sa.String(255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("server_name")
