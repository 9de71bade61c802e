"""Why a lease was reclaimed, as a code (``leases.reclaim_code``: ``idle``,
``heartbeat``, ``pressure``; ``rules.reclaim.Reclaim``) beside the words of
``leases.reason``, so ``gpupool_reclaims_total{reason}`` counts by the code
instead of matching the words.

Existing reclaimed leases (and those releasing to be reclaimed) get the code
their words began with (the patterns the metrics matched before this
revision), so the counter reads the same after the upgrade; other rows get NULL.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

#: How the reclaim reasons began, up to this revision -> their code.
_BEGAN = {"idle for %": "idle", "the notebook kernel stopped sending heartbeats%": "heartbeat",
          "parked early: %": "pressure"}


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("reclaim_code", sa.String(20), nullable=True))
    for pattern, code in _BEGAN.items():
        # end_state too: a lease still releasing (the service stopped mid-release) ends reclaimed later.
        op.execute(sa.text("UPDATE leases SET reclaim_code = :code WHERE (state = 'reclaimed' OR end_state = "
                           "'reclaimed') AND reason LIKE :began").bindparams(code=code, began=pattern))


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("reclaim_code")
