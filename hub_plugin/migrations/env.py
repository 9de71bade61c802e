"""Alembic environment: runs on the connection the service hands over
(``config.attributes["connection"]``), or on ``sqlalchemy.url`` otherwise."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from gpupool.hub_plugin.models import Base

target_metadata = Base.metadata


def _run(connection) -> None:
    # render_as_batch: SQLite cannot ALTER most things; batch mode copies the table.
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True,
                      compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


connection = context.config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    engine = create_engine(context.config.get_main_option("sqlalchemy.url"))
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()
