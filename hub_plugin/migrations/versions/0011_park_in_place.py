"""Park in place (docs/parking.md): on ``leases`` what the idle timeout does
(``on_idle``), the current span holding a GPU share (``held_since``), the
seconds parked so far and the park itself (tier, why as a code and in words,
since when, checkpointer, bytes held, moved and kept, what was lost, a resume
asked for); on ``nodes`` the agent's checkpointer and parked-memory budget.

The usage ledger becomes one row per span a lease held a GPU share (unique per
lease and span start, was: per lease), so time parked is in no row.

Existing leases keep ``on_idle`` ``park`` (the wire's default), and those
that started and have not ended hold their share since they started.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_PARK_COLUMNS = (
    ("park_tier", sa.String(10)), ("park_code", sa.String(20)), ("park_reason", sa.Text()),
    ("parked_at", sa.DateTime()), ("park_checkpointer", sa.String(50)), ("parked_host_bytes", sa.BigInteger()),
    ("parked_disk_bytes", sa.BigInteger()), ("gpu_bytes_moved", sa.BigInteger()), ("gpu_bytes_kept", sa.BigInteger()),
    ("parked_lost", sa.JSON()), ("resume_requested_at", sa.DateTime()))
#: The ledger's unique lease id as revision 0002 made it: PostgreSQL names it, SQLite keeps it unnamed
#: (batch mode names it by this convention to drop it).
_NAMES = {"uq": "uq_%(table_name)s_%(column_0_name)s"}


def _old_unique() -> str:
    return "usage_ledger_lease_id_key" if op.get_bind().dialect.name == "postgresql" else "uq_usage_ledger_lease_id"


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("on_idle", sa.String(10), nullable=False, server_default="park"))
        batch.add_column(sa.Column("held_since", sa.DateTime(), nullable=True))
        batch.add_column(sa.Column("parked_seconds", sa.Float(), nullable=False, server_default="0"))
        for name, kind in _PARK_COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=True))
    op.execute(sa.text("UPDATE leases SET held_since = started_at WHERE started_at IS NOT NULL AND ended_at IS NULL"))
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("checkpointer", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("parked_memory", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("usage_ledger", naming_convention=_NAMES) as batch:
        batch.drop_constraint(_old_unique(), type_="unique")
        batch.create_unique_constraint("uq_usage_ledger_span", ["lease_id", "started_at"])


def downgrade() -> None:
    with op.batch_alter_table("usage_ledger", naming_convention=_NAMES) as batch:
        batch.drop_constraint("uq_usage_ledger_span", type_="unique")
    # Spans of one lease become one row again: their sums, from the first span's start to the last's end.
    op.execute(sa.text(
        "UPDATE usage_ledger SET gpu_seconds = (SELECT SUM(u.gpu_seconds) FROM usage_ledger u WHERE "
        "u.lease_id = usage_ledger.lease_id), started_at = (SELECT MIN(u.started_at) FROM usage_ledger u WHERE "
        "u.lease_id = usage_ledger.lease_id), ended_at = (SELECT MAX(u.ended_at) FROM usage_ledger u WHERE "
        "u.lease_id = usage_ledger.lease_id)"))
    op.execute(sa.text("DELETE FROM usage_ledger WHERE id NOT IN (SELECT MIN(u.id) FROM usage_ledger u "
                       "GROUP BY u.lease_id)"))
    with op.batch_alter_table("usage_ledger", naming_convention=_NAMES) as batch:
        batch.create_unique_constraint(_old_unique(), ["lease_id"])
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("parked_memory")
        batch.drop_column("checkpointer")
    with op.batch_alter_table("leases") as batch:
        for name, _ in reversed(_PARK_COLUMNS):
            batch.drop_column(name)
        batch.drop_column("parked_seconds")
        batch.drop_column("held_since")
        batch.drop_column("on_idle")
