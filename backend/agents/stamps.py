"""Heartbeat stamps held in the API process and written together (docs/architecture.md,
"Monitoring": coalesced heartbeats).

A heartbeat of an online agent writes nothing itself: its time goes into `HeldStamps`, with
the time of each rank it reported alive, and `StampFlusher` writes what is held at most once a
second, in one statement per table (PostgreSQL: `UPDATE ... FROM unnest(arrays)`, the
held rows as a table; SQLite: one executemany) and one commit. A crash loses at most the
stamps of the last period; why that cannot declare a live agent lost is in
docs/architecture.md.
"""

import logging
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import cast

from sqlalchemy import Table, and_, bindparam, text, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from backend.agents.models import Agent
from backend.tasks.models import Allocation

log = logging.getLogger(__name__)
FLUSH_EVERY_S = 1.0
"""The longest a held stamp waits before it is written (the flusher's period)."""
AGENT_TABLE, ALLOCATION_TABLE = cast(Table, Agent.__table__), cast(Table, Allocation.__table__)


class HeldStamps:
    """The latest heartbeat time of each agent, and of each (task, rank) reported alive, not
    written yet. Thread-safe: the request threads note, the flusher takes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._agents: dict[int, datetime] = {}
        self._ranks: dict[tuple[int, int], datetime] = {}
        self._online: dict[int, float] = {}  # agent -> when a read saw it online (monotonic)
        self.flushing = False
        """True while a `StampFlusher` writes these stamps; else a caller flushes itself."""

    def saw_online(self, agent_id: int) -> None:
        """The database said, just now, that the agent is online."""
        with self._lock:
            self._online[agent_id] = time.monotonic()

    def known_online(self, agent_id: int, within_s: float) -> bool:
        """True when a read of this process saw the agent online within the last
        `within_s` seconds: its beat need not read the row again (`backend.agents.service
        .beat`; why `within_s` must not exceed the liveness timeout: docs/architecture.md,
        "Monitoring")."""
        with self._lock:
            seen = self._online.get(agent_id)
        return seen is not None and time.monotonic() - seen < within_s

    def agent(self, agent_id: int, at: datetime) -> None:
        with self._lock:
            self._agents[agent_id] = max(at, self._agents.get(agent_id, at))

    def ranks(self, task_id: int, ranks: Iterable[int], at: datetime) -> None:
        with self._lock:
            for rank in ranks:
                key = (task_id, rank)
                self._ranks[key] = max(at, self._ranks.get(key, at))

    def forget_agent(self, agent_id: int) -> None:
        """Drop an agent's held stamp and what was seen of it (it deregistered: nothing to
        write after that, and its next beat reads its row)."""
        with self._lock:
            self._agents.pop(agent_id, None)
            self._online.pop(agent_id, None)

    def held(self) -> tuple[dict[int, datetime], dict[tuple[int, int], datetime]]:
        """A copy of what is held (tests)."""
        with self._lock:
            return dict(self._agents), dict(self._ranks)

    def _take(self) -> tuple[dict[int, datetime], dict[tuple[int, int], datetime]]:
        with self._lock:
            taken = self._agents, self._ranks
            self._agents, self._ranks = {}, {}
            return taken

    def _put_back(
        self, agents: dict[int, datetime], ranks: dict[tuple[int, int], datetime]
    ) -> None:
        """Hold again what a failed write took, unless a newer stamp came meanwhile."""
        with self._lock:
            for agent_id, at in agents.items():
                self._agents[agent_id] = max(at, self._agents.get(agent_id, at))
            for key, at in ranks.items():
                self._ranks[key] = max(at, self._ranks.get(key, at))

    def flush(self, session: Session) -> tuple[int, int]:
        """Write every held stamp (an agent's only where it moves forward; a rank's on its
        held allocation) and commit; (agents, ranks) written. What a write that failed for
        the database's connection took is held again; what the database refused is dropped
        (it would fail again, and every stamp with it); the error is raised either way."""
        agents, ranks = self._take()
        if not agents and not ranks:
            return 0, 0
        try:
            write_stamps(session, agents, ranks)
            session.commit()
        except OperationalError:  # the database away: held again for the next period
            session.rollback()
            self._put_back(agents, ranks)
            raise
        except Exception:
            # Anything else would fail again each period and hold every other stamp with it
            # (the monitor would then declare live agents lost): dropped, the agents' next
            # beats hold new ones. Contracts bound what can arrive (`contracts.agent_api.DbId`).
            session.rollback()
            log.exception("held heartbeat stamps dropped: the database refused them")
            raise
        return len(agents), len(ranks)


AGENTS_FROM_ARRAYS = text(
    "UPDATE agent SET last_heartbeat_at = held.at"
    " FROM unnest(CAST(:ids AS bigint[]), CAST(:ats AS timestamp[])) AS held(id, at)"
    " WHERE agent.id = held.id AND agent.last_heartbeat_at < held.at"
)
RANKS_FROM_ARRAYS = text(
    "UPDATE allocation SET last_heartbeat_at = alive.at"
    " FROM unnest(CAST(:tasks AS bigint[]), CAST(:ranks AS bigint[]),"
    " CAST(:ats AS timestamp[])) AS alive(task_id, rank, at)"
    " WHERE allocation.task_id = alive.task_id AND allocation.rank = alive.rank"
    " AND allocation.released_at IS NULL"
)
"""PostgreSQL: every held stamp of a table in one statement, `UPDATE ... FROM (the rows of
the held values)`; the rows come as arrays (`unnest`), so the statement's text is the same
whatever their number (no statement of thousands of parameters to build each second)."""


def write_stamps(
    session: Session, agents: dict[int, datetime], ranks: dict[tuple[int, int], datetime]
) -> None:
    """One statement per table: `UPDATE ... FROM unnest(...)` on PostgreSQL, an executemany
    of one UPDATE elsewhere (SQLite). The caller commits."""
    connection = session.connection()
    if connection.dialect.name == "postgresql":
        if agents:
            connection.execute(
                AGENTS_FROM_ARRAYS, {"ids": list(agents), "ats": list(agents.values())}
            )
        if ranks:
            connection.execute(
                RANKS_FROM_ARRAYS,
                {
                    "tasks": [task_id for task_id, _ in ranks],
                    "ranks": [rank for _, rank in ranks],
                    "ats": list(ranks.values()),
                },
            )
        return
    if agents:
        connection.execute(
            update(AGENT_TABLE)
            .where(
                and_(
                    AGENT_TABLE.c.id == bindparam("held_id"),
                    AGENT_TABLE.c.last_heartbeat_at < bindparam("held_at"),
                )
            )
            .values(last_heartbeat_at=bindparam("held_at")),
            [{"held_id": agent_id, "held_at": at} for agent_id, at in agents.items()],
        )
    if ranks:
        connection.execute(
            update(ALLOCATION_TABLE)
            .where(
                ALLOCATION_TABLE.c.task_id == bindparam("held_task"),
                ALLOCATION_TABLE.c.rank == bindparam("held_rank"),
                ALLOCATION_TABLE.c.released_at.is_(None),
            )
            .values(last_heartbeat_at=bindparam("held_at")),
            [
                {"held_task": task_id, "held_rank": rank, "held_at": at}
                for (task_id, rank), at in ranks.items()
            ],
        )


class StampFlusher:
    """A thread writing `stamps` every `period_s` seconds with a session of its own, and once
    more when stopped (a clean shutdown loses no stamp)."""

    def __init__(
        self,
        stamps: HeldStamps,
        sessions: Callable[[], Session],
        period_s: float = FLUSH_EVERY_S,
    ) -> None:
        self.stamps, self.sessions, self.period_s = stamps, sessions, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat-stamps", daemon=True)

    def start(self) -> None:
        self.stamps.flushing = True
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.stamps.flushing = False
        self.flush_once()

    def flush_once(self) -> None:
        try:
            with self.sessions() as session:
                self.stamps.flush(session)
        except Exception:  # held again; the next period tries again
            log.warning("writing the held heartbeat stamps failed", exc_info=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.flush_once()
