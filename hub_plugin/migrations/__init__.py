"""Alembic migrations of the store, applied by the service at start
(:func:`upgrade`; no ``alembic.ini``). How to write the next revision:
docs/code.md, "Migrations".
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

HERE = Path(__file__).resolve().parent


def config(url: str | None = None) -> Config:
    """An Alembic Config pointing at this folder (and at ``url`` if given)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    if url:
        cfg.set_main_option("sqlalchemy.url", url)
    return cfg


def upgrade(connection, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` on ``connection`` (inside its transaction)."""
    cfg = config()
    cfg.attributes["connection"] = connection
    command.upgrade(cfg, revision)
