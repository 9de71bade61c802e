"""The SQL store: engine, sessions, serialized write transactions, migrations,
on SQLite (the default) or PostgreSQL. The capacity check and a new lease's
reservation are one serialized transaction (``BEGIN IMMEDIATE``, or an
advisory lock: :meth:`Store.lock_capacity`); why and how: docs/code.md,
"The SQL store".
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from gpupool.errors import GPUPoolError, Reason

log = logging.getLogger("gpupool.service.db")
#: Key of the PostgreSQL advisory lock that serializes capacity decisions ("gpupool" in ASCII).
CAPACITY_LOCK_KEY = 0x677075706F6F6C

#: Seconds a transaction waits for another one's lock before giving up with 503.
#: Short on purpose: the service runs its SQL on the event loop thread.
BUSY_TIMEOUT_S = 5.0

# SQLSTATEs of PostgreSQL that mean "retry": lock_not_available,
# serialization_failure, deadlock_detected.
_PG_RETRYABLE = {"55P03", "40001", "40P01"}


class Store:
    """Sessions on one database. Use :meth:`read` for queries and
    :meth:`write` for anything that changes rows."""

    def __init__(self, url: str) -> None:
        self.url = make_url(url)
        self.engine = _make_engine(url)
        self.is_sqlite = self.engine.dialect.name == "sqlite"
        self._reader = sessionmaker(self.engine, expire_on_commit=False)
        # The execution option marks write transactions for the SQLite "begin" hook.
        self._writer = sessionmaker(self.engine.execution_options(gpupool_write=True), expire_on_commit=False)

    def describe(self) -> str:
        """The URL without its password, for logs."""
        return self.url.render_as_string(hide_password=True)

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A session for queries; rolled back at the end."""
        with _translated(), self._reader() as session:
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A serialized write transaction: committed when the block ends,
        rolled back if it raises. Raises GPUPoolError 503 when the store is busy."""
        with _translated(), self._writer() as session:
            with session.begin():
                yield session

    def lock_capacity(self, session: Session) -> None:
        """Serialize capacity decisions: call first in a write transaction that
        reads allocation and then reserves it."""
        if self.is_sqlite:
            # Begin now: BEGIN IMMEDIATE takes the database's write lock.
            session.connection()
        else:
            # One transaction-scoped advisory lock serializes every capacity and
            # quota decision, also when there are no GPU rows to lock (a queued
            # request in an empty pool). The chosen GPUs' rows are locked when the
            # decision is checked (capacity.CapacityIndex.verify), not every GPU's.
            session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": CAPACITY_LOCK_KEY})

    def migrate(self) -> None:
        """Bring the schema to the latest Alembic revision."""
        from .migrations import upgrade

        with self.engine.begin() as connection:
            upgrade(connection)

    def close(self) -> None:
        self.engine.dispose()


def _make_engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            _owner_only(Path(parsed.database))
        engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_S})
        event.listen(engine, "connect", _sqlite_connect)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    if parsed.get_backend_name() == "postgresql":
        timeout_ms = int(BUSY_TIMEOUT_S * 1000)
        return create_engine(url, pool_pre_ping=True,
                             connect_args={"options": f"-c lock_timeout={timeout_ms}", "connect_timeout": 10})
    return create_engine(url, pool_pre_ping=True)


def _owner_only(database: Path) -> None:
    """Create the SQLite file (and its directory) readable by the service's
    user only, and make an existing one so: it holds every active worker's
    connection key. SQLite gives its -wal and -shm files the database's mode."""
    database.parent.mkdir(parents=True, exist_ok=True)
    database.touch(mode=0o600, exist_ok=True)
    for path in (database, *(database.with_name(database.name + s) for s in ("-wal", "-shm", "-journal"))):
        if path.exists():
            path.chmod(0o600)


def _sqlite_connect(dbapi_connection, _record) -> None:
    # Take transaction control from the sqlite3 module so "begin" below decides
    # how each transaction starts (SQLAlchemy's pysqlite recipe).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _sqlite_begin(connection) -> None:
    write = connection.get_execution_options().get("gpupool_write", False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


@contextmanager
def _translated() -> Iterator[None]:
    """Turn a busy or unreachable store into a retryable 503."""
    try:
        yield
    except OperationalError as exc:
        if _is_busy(exc):
            log.warning("store busy: %s", exc.orig)
            raise GPUPoolError(Reason.store_busy, "the pool's database is busy; try again in a moment", 503,
                               log_message=f"store busy: {exc.orig}") from exc
        log.error("store unavailable: %s", exc.orig)
        raise GPUPoolError(Reason.store_unavailable, "the pool's database is unavailable; try again later "
                           "(an admin can check the service log)", 503,
                           log_message=f"store unavailable: {exc.orig}") from exc


def _is_busy(exc: DBAPIError) -> bool:
    orig = exc.orig
    if getattr(orig, "sqlstate", None) in _PG_RETRYABLE:
        return True
    text = str(orig).lower()
    return "database is locked" in text or "database table is locked" in text
