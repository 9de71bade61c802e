"""Host CPU and memory in a slice: each node's cores and RAM as its agent
reported them (``nodes.host_cpus``, ``nodes.host_memory`` in bytes), and per
lease what it holds on its node's host (``leases.cpus``,
``leases.host_memory``) and what the request named (``requested_cpus``,
``requested_host_memory``; NULL: the default share).

Existing rows get NULL: nodes report their host at their next registration;
leases held before hold no host resources.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

LEASE_COLUMNS = (("cpus", sa.Float()), ("host_memory", sa.BigInteger()), ("requested_cpus", sa.Float()),
                 ("requested_host_memory", sa.BigInteger()))


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("host_cpus", sa.Float(), nullable=True))
        batch.add_column(sa.Column("host_memory", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("leases") as batch:
        for name, kind in LEASE_COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        for name, _ in reversed(LEASE_COLUMNS):
            batch.drop_column(name)
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("host_memory")
        batch.drop_column("host_cpus")
