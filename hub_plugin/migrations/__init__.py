"""Alembic migrations of the store, applied by the service at start
(:func:`upgrade`; no ``alembic.ini``). How to write the next revision:
docs/code.md, "Migrations".
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from gpupool.errors import GPUPoolError, Reason

HERE = Path(__file__).resolve().parent


def config(url: str | None = None) -> Config:
    """An Alembic Config pointing at this folder (and at ``url`` if given)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    if url:
        cfg.set_main_option("sqlalchemy.url", url)
    return cfg


def upgrade(connection, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` on ``connection`` (inside its transaction).

    Raises GPUPoolError ``store_unavailable`` (503), and changes nothing, when
    the store's schema is at a revision this release does not know: a newer
    gpupool upgraded it, and this one was rolled back (Alembic's own
    ``CommandError`` would be a traceback that names no way out)."""
    cfg = config()
    cfg.attributes["connection"] = connection
    _refuse_unknown_revision(connection, ScriptDirectory.from_config(cfg))
    command.upgrade(cfg, revision)


def _refuse_unknown_revision(connection, scripts: ScriptDirectory) -> None:
    """Raise GPUPoolError when ``connection``'s ``alembic_version`` names a
    revision that is not among ``scripts`` (none yet, a new store, is fine)."""
    known = {script.revision for script in scripts.walk_revisions()}
    unknown = sorted(set(MigrationContext.configure(connection).get_current_heads()) - known)
    if unknown:
        newest = ", ".join(scripts.get_heads())
        raise GPUPoolError(Reason.store_unavailable, f"the store's schema is at revision {', '.join(unknown)}, which "
                           f"this gpupool does not know; the newest it knows is {newest}. A newer gpupool upgraded "
                           "it: run that release, or restore the database backup taken before the upgrade", 503)
