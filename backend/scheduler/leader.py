"""One scheduler among several API processes: who runs it (docs/architecture.md, "Several API
processes, one scheduler").

On PostgreSQL every API process is a candidate; the one whose own connection holds the
session-level advisory lock `LEADER_LOCK` runs the scheduler's passes and the liveness
monitor, **on that connection**. PostgreSQL releases a session lock only when the session
ends, after rolling back its open transaction, so every write of a pass commits while its
process holds the lock: a leader that lost the lock (its connection dropped, its session
ended by the server) cannot commit anything more, and the next leader's first commit comes
after the lock was free. A connection this election opens takes the lock before any
statement of a pass can use it (`Election._claim`, a `connect` event): if SQLAlchemy
reconnects under a pass, the new session wins the lock or refuses to be used.

The lock's session is given the lease period (`Settings.scheduler_lease_s`) as its
`idle_session_timeout`, `idle_in_transaction_session_timeout` and `tcp_user_timeout` (and
checks for a vanished client as often, `client_connection_check_interval`): a
leader that stops talking to the database (stalled, partitioned, its host gone) has its
session ended by the server one period after its last statement, so the lock does not
outlive a leader that cannot use it. A leader runs a pass at least every third of a period.
Candidates try every half period: a dead leader's lock is taken over within 1.5 periods
(at once after a crash: the kernel closes its socket), under the two periods promised.

On SQLite the embedded default runs one API process: `hold_sqlite` refuses a second one on
the same database file.
"""

import fcntl
import logging
import os
import socket
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, make_url
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool

from backend.core.db import utcnow

log = logging.getLogger(__name__)

LEADER_LOCK = 0x706F6C7973636864  # "polyschd": the advisory lock key of the scheduler's leader
SINCE_14 = 140000  # PostgreSQL 14 added idle_session_timeout, client_connection_check_interval


class NotLeader(Exception):
    """Another session holds the scheduler's lock."""


def process_name() -> str:
    """This process as the lock's session names it (`application_name`, pg_stat_activity)."""
    return f"polytrain scheduler {socket.gethostname()}:{os.getpid()}"[:63]


LEADING_SESSION_SQL = (
    "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s AND l.objid = %s "
    "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)
"""The name (:func:`process_name`) of the session holding the scheduler's lock on the current
database, for an operator's or a test's own DB-API connection: run it with
`LEADING_SESSION_PARAMS`, then read the pid with :func:`leader_pid_in`."""
LEADING_SESSION_PARAMS = (LEADER_LOCK >> 32, LEADER_LOCK & 0xFFFFFFFF)


def leader_pid_in(name: str) -> int | None:
    """The pid in a leading session's name (:func:`process_name`); None when the 63
    characters PostgreSQL keeps cut it off (a very long host name)."""
    try:
        return int(name.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


class Election:
    """This process's candidacy for the scheduler on the PostgreSQL database of `url`.

    `acquire()` returns the connection that holds the lock (opening one if this process holds
    none), or None while another process leads or the database cannot be reached. The
    scheduler runs its passes on that connection only. `release()` closes it: the lock is
    free for the others at once (a stopping API process hands over without waiting).
    """

    def __init__(self, url: str, *, lease_s: float, name: str | None = None) -> None:
        self.lease_s = lease_s
        self.name = name or process_name()
        self.engine = create_engine(
            url, poolclass=NullPool, connect_args={"application_name": self.name}
        )
        event.listen(self.engine, "connect", self._claim)
        self.connection: Connection | None = None
        self.since: datetime | None = None  # when this process last took the lock (naive UTC)

    @property
    def retry_s(self) -> float:
        """How long a candidate waits between tries: half a lease period."""
        return self.lease_s / 2

    def _claim(self, dbapi_connection: Any, _record: object) -> None:
        """A new session of this election: bound its silence by the lease period, then take
        the lock, or refuse the connection (SQLAlchemy closes it) with NotLeader."""
        period_ms = str(max(1, round(self.lease_s * 1000)))
        limits = ["idle_in_transaction_session_timeout", "tcp_user_timeout"]
        if dbapi_connection.info.server_version >= SINCE_14:
            limits += ["idle_session_timeout", "client_connection_check_interval"]
        with dbapi_connection.cursor() as cursor:
            for setting in limits:
                cursor.execute("SELECT set_config(%s, %s, false)", (setting, period_ms))
            cursor.execute("SELECT pg_try_advisory_lock(%s)", (LEADER_LOCK,))
            row = cursor.fetchone()
        dbapi_connection.commit()
        if not row or not row[0]:
            raise NotLeader("another API process runs the scheduler")
        self.since = utcnow()

    @property
    def leading(self) -> bool:
        """Whether this process holds a live connection with the lock (as far as it knows)."""
        connection = self.connection
        return connection is not None and not connection.closed and not connection.invalidated

    def acquire(self) -> Connection | None:
        """The connection holding the lock, taken now if free; None if another holds it."""
        if self.leading:
            return self.connection
        self.release()  # a connection the database dropped: its lock is gone with it
        try:
            self.connection = self.engine.connect()
        except NotLeader:
            return None
        except Exception as exc:  # noqa: BLE001 - the database is down: try again later
            log.warning("scheduler election: cannot reach the database: %s", exc)
            return None
        log.info("%s now runs the scheduler", self.name)
        return self.connection

    def release(self) -> None:
        """Free the lock and close its connection. The lock is unlocked first, so another
        candidate can take it as soon as this returns (closing alone frees it only once the
        server has ended the session, a moment later)."""
        connection, self.connection = self.connection, None
        if connection is None:
            return
        try:
            connection.exec_driver_sql("SELECT pg_advisory_unlock(%s)", (LEADER_LOCK,))
        except Exception:  # noqa: BLE001 - a dropped session has freed it already
            log.debug("unlocking the scheduler's lock failed", exc_info=True)
        try:
            connection.close()
        except Exception:  # noqa: BLE001 - already broken: closed all the same
            log.debug("closing the scheduler's connection failed", exc_info=True)
        log.info("%s no longer runs the scheduler", self.name)

    def dispose(self) -> None:
        self.release()
        self.engine.dispose()


class SqliteInUse(Exception):
    """Another API process serves the same SQLite database."""


def hold_sqlite(url: str) -> int | None:
    """Make this the only API process on the SQLite database of `url`: an exclusive lock on
    `<database>.api.lock` held until the process exits (the kernel drops it when it dies, so
    no stale lock outlives a crash). Returns the lock file's descriptor (keep it open), or
    None for an in-memory database.

    Raises:
        SqliteInUse: another process holds it (its pid in the message when known).
    """
    database = make_url(url).database
    if not database or database == ":memory:":
        return None
    path = Path(f"{database}.api.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise SqliteInUse(
            f"another API process (pid {holder}) serves the SQLite database {database}: "
            "the embedded default runs one API process (its scheduler's allocation lock "
            "holds between one process's threads only); stop it, or use PostgreSQL "
            "(DATABASE_URL) for several"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd
