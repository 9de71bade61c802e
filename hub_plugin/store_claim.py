"""One pool service per store. The service decides in memory as well as in
SQL (its queue's order, the nodes it clears for a waiting request, its
sweeps), so a second service on the same database would place and reclaim
leases past the first. A PostgreSQL store is claimed with a session-level
advisory lock, held on a connection of its own for the service's life (the
server drops it when that connection ends, a crash included); a SQLite file
with a lock on a file beside it (``flock``), as the state directory is.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError

from gpupool.errors import GPUPoolError, Reason

from .db import CAPACITY_LOCK_KEY, Store

#: Key of the PostgreSQL advisory lock the serving service holds (next to the capacity lock's).
SERVICE_LOCK_KEY = CAPACITY_LOCK_KEY + 1


class StoreClaim:
    """This service's hold on its store; :meth:`release` at stop (the
    process's end releases it too)."""

    def __init__(self, connection: Connection | None = None, fd: int | None = None) -> None:
        self._connection, self._fd = connection, fd

    def release(self) -> None:
        if self._connection is not None:
            self._connection.close()  # ends the session: the server drops its advisory lock
            self._connection = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def claim(store: Store) -> StoreClaim:
    """Claim ``store`` for this service. GPUPoolError ``not_configured``
    when another service holds it; ``store_unavailable`` when the database
    cannot be reached. In-memory SQLite needs no claim."""
    if store.is_sqlite:
        database = store.url.database
        if not database or database == ":memory:":
            return StoreClaim()
        return StoreClaim(fd=_lock_file(Path(database)))
    try:
        connection = store.engine.connect()
        held = connection.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": SERVICE_LOCK_KEY}).scalar()
        connection.commit()  # the lock is the session's, not the transaction's
    except SQLAlchemyError as exc:
        reason = getattr(exc, "orig", None) or exc
        raise GPUPoolError(Reason.store_unavailable, f"cannot open the store at {store.describe()} ({reason}); "
                           "check c.GPUPool.db_url") from None
    if not held:
        connection.close()
        raise GPUPoolError(Reason.not_configured, _taken(store.describe()))
    return StoreClaim(connection=connection)


def _lock_file(database: Path) -> int:
    """Hold ``DATABASE.service.lock`` (beside the SQLite file); its descriptor."""
    path = database.with_name(database.name + ".service.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise GPUPoolError(Reason.not_configured, _taken(str(database))) from None
    return fd


def _taken(where: str) -> str:
    return (f"another gpupool service serves the store at {where}: one service per store (two would place "
            "leases past each other); stop it first, or give this one its own c.GPUPool.db_url")
