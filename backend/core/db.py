"""Database engine, session factory and declarative base."""

from collections.abc import Iterator
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path

from sqlalchemy import MetaData, create_engine, event, make_url
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

from backend.core.config import get_settings, private_file

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def utcnow() -> datetime:
    """Current time in UTC, naive: stored as-is by SQLite and PostgreSQL alike."""
    return datetime.now(UTC).replace(tzinfo=None)


def _sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
    # WAL lets the API's reader threads work while the scheduler writes.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _private_sqlite_files(url: str) -> None:
    """The database file and its WAL and shared-memory files: mode 0600 (data dir: 0700)."""
    database = make_url(url).database
    if database and database != ":memory:":
        for suffix in ("", "-wal", "-shm"):
            private_file(Path(database + suffix))


def make_engine(url: str) -> Engine:
    """Create an engine for `url`; SQLite gets WAL, a busy timeout, foreign keys and
    owner-only file modes."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "connect", lambda *_: _private_sqlite_files(url))
        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=20, max_overflow=10)


@lru_cache
def get_engine() -> Engine:
    return make_engine(get_settings().resolved_database_url())


@lru_cache
def get_sessionmaker() -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(), expire_on_commit=False)


def release(session: Session) -> None:
    """End a read's transaction now, giving its connection back to the pool.

    For a synchronous route that only reads: FastAPI validates such a route's answer in its
    threadpool before the request's session closes, so without this the connection stays
    checked out ("idle in transaction") while the request waits for a free thread. Under a
    burst of requests (e.g. many agents registering at once, each asking its group's device
    first) every thread could wait for a connection that such requests hold, a deadlock
    until the pool's timeout (docs/scaling.md). Loaded objects stay usable
    (`expire_on_commit=False`).
    """
    session.commit()


def get_session() -> Iterator[Session]:
    """FastAPI dependency: one session per request, closed afterwards."""
    with get_sessionmaker()() as session:
        yield session
