"""Initial schema: nodes, GPUs, leases, the GPUs each lease holds, lease events.

Revision ID: 0001
Revises:
Create Date: 2026-11-29

Times are naive UTC ``DateTime`` columns (models.UTCDateTime adds the zone
when reading); memory is ``BigInteger`` bytes.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "nodes",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("url", sa.String(500), nullable=False),
        sa.Column("inventory", sa.String(20), nullable=False),
        sa.Column("enforcement", sa.String(50), nullable=True),
        sa.Column("state", sa.String(10), nullable=False),
        sa.Column("registered_at", sa.DateTime(), nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime(), nullable=False),
    )
    op.create_table(
        "gpus",
        sa.Column("uuid", sa.String(200), primary_key=True),
        sa.Column("node_name", sa.String(200), sa.ForeignKey("nodes.name", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("memory_total", sa.BigInteger(), nullable=False),
        sa.Column("memory_reserved", sa.BigInteger(), nullable=False),
        sa.Column("compute_capability", sa.String(20), nullable=True),
        sa.Column("memory_used", sa.BigInteger(), nullable=True),
        sa.Column("utilization", sa.Float(), nullable=True),
        sa.Column("memory_unattributed", sa.BigInteger(), nullable=True),
        sa.Column("healthy", sa.Boolean(), nullable=False),
    )
    op.create_index("ix_gpus_node_name", "gpus", ["node_name"])
    op.create_table(
        "leases",
        sa.Column("id", sa.String(20), primary_key=True),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("state", sa.String(12), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("end_state", sa.String(12), nullable=True),
        sa.Column("fraction", sa.Float(), nullable=False),
        sa.Column("gpu_count", sa.Integer(), nullable=False),
        sa.Column("memory", sa.BigInteger(), nullable=False),
        sa.Column("node_name", sa.String(200), sa.ForeignKey("nodes.name"), nullable=True),
        sa.Column("kernel_id", sa.String(200), nullable=True),
        sa.Column("idle_timeout", sa.Float(), nullable=False),
        sa.Column("heartbeat_ttl", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.Column("last_heartbeat_at", sa.DateTime(), nullable=True),
        sa.Column("idle_since", sa.DateTime(), nullable=True),
        sa.Column("worker_pid", sa.Integer(), nullable=True),
        sa.Column("worker_state", sa.String(10), nullable=True),
        sa.Column("connection", sa.JSON(), nullable=True),
        sa.Column("usage_gpu_seconds", sa.Float(), nullable=False),
    )
    for column in ("owner", "state", "node_name", "kernel_id"):
        op.create_index(f"ix_leases_{column}", "leases", [column])
    op.create_table(
        "lease_gpus",
        sa.Column("lease_id", sa.String(20), sa.ForeignKey("leases.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("gpu_uuid", sa.String(200), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
    )
    op.create_index("ix_lease_gpus_gpu_uuid", "lease_gpus", ["gpu_uuid"])
    op.create_table(
        "lease_events",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("lease_id", sa.String(20), sa.ForeignKey("leases.id", ondelete="CASCADE"), nullable=False),
        sa.Column("state", sa.String(12), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
    )
    op.create_index("ix_lease_events_lease_id", "lease_events", ["lease_id"])


def downgrade() -> None:
    for table in ("lease_events", "lease_gpus", "leases", "gpus", "nodes"):
        op.drop_table(table)
