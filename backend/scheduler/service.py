"""The scheduler's decision: take the queue head, place the first task that fits, book it.

The scheduler in named parts, each a module of this package:

- :mod:`queue`: the head of the queue (priority, then age; an index scan of at
  most `WINDOW` tasks);
- :mod:`capacity`: each group's free workers, under the allocation lock;
- :mod:`placement`: which groups and how many workers a task gets;
- :mod:`booking`: the nodes, sub-tasks and SCHEDULED event written for it
  (gang allocation: all of a task's nodes at once or none);
- :mod:`dispatch`: the messages to the groups' queues (the only publisher);
- :mod:`monitor`: agents that stopped, and the tasks they ran;
- `backend.sweeps.service.advance_all`: each running sweep's median stopping rule and its
  next trials, before the queue is read (so a new trial may be booked in the same pass);
- :mod:`regrow`: a shrunk task taken in again on its whole request at an epoch end
  (decided when its epoch-end checkpoint arrives, not by the pass).

A decision holds the allocation lock from reading free capacity to commit, so
several schedulers (threads or API processes) never book the same workers. On
PostgreSQL a decision is two round trips: the lock, capacity and queue head as
one psycopg pipeline; then the booking as one statement pipelined with COMMIT.
"""

import logging
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend.scheduler import capacity, dispatch, monitor, placement
from backend.scheduler.booking import allocate, driver
from backend.scheduler.capacity import GroupFree
from backend.scheduler.dispatch import Dispatcher
from backend.scheduler.queue import HEAD, WINDOW, Queued, queue_head
from backend.sweeps import service as sweeps

log = logging.getLogger(__name__)
MAX_PER_PASS = 64  # tasks one pass schedules, at most
RETRIES = 3  # decisions made again after a task stopped being queued, at most

# PostgreSQL: the allocation lock, and an asynchronous commit for this transaction only
# (a decision is made durable before anything outside the database acts on it: see
# `dispatch.make_durable`). Plain index scans for the capacity join: they mark the
# entries of released allocations dead as they pass, a bitmap scan does not.
_BEGIN_PG = select(
    func.set_config("synchronous_commit", "off", True),
    func.set_config("enable_bitmapscan", "off", True),
    func.pg_advisory_xact_lock(capacity.ALLOCATION_LOCK),
)


def _read(session: Session) -> tuple[dict[str, GroupFree], list[Queued]]:
    """Free capacity and the queue head under the allocation lock (any database)."""
    capacity.lock_allocation(session)
    free = capacity.free_capacity(session)
    return free, (queue_head(session) if any(g.free for g in free.values()) else [])


def _compiled(statement: Any, dialect: Any) -> str:
    return str(statement.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))


@cache
def _pipelined_reads(dialect: Any) -> tuple[str, str, str, str]:
    """The lock, capacity (groups, agents) and queue-head statements as the driver's SQL
    (compiled once)."""
    return (
        _compiled(_BEGIN_PG, dialect),
        _compiled(capacity.FREE, dialect),
        _compiled(capacity.AGENTS, dialect),
        _compiled(HEAD.limit(WINDOW), dialect),
    )


def _read_postgresql(session: Session) -> tuple[dict[str, GroupFree], list[Queued]]:
    """`_read` in one round trip: BEGIN, the lock, capacity and queue head sent as one psycopg
    pipeline. PostgreSQL runs them in order and takes a new snapshot per statement, so the
    reads see every allocation committed before the lock was granted."""
    lock_sql, free_sql, agents_sql, head_sql = _pipelined_reads(session.get_bind().dialect)
    connection = driver(session)
    with (
        connection.cursor() as lock,
        connection.cursor() as free,
        connection.cursor() as agents,
        connection.cursor() as head,
    ):
        # Sent, and every result read, at the block's end. Prepared: planned once per
        # connection (planning the capacity join costs more than running it).
        with connection.pipeline():
            lock.execute(lock_sql, prepare=True)
            free.execute(free_sql, prepare=True)
            agents.execute(agents_sql, prepare=True)
            head.execute(head_sql, prepare=True)
        return (
            capacity.free_from_rows(free.fetchall(), agents.fetchall()),
            [Queued(*row) for row in head.fetchall()],
        )


def schedule_next(session: Session) -> int | None:
    """One scheduling decision: allocate the first queued task that fits now, if any.

    Returns the scheduled task's id (committed, not yet dispatched) or None. On
    PostgreSQL its commit does not wait for the WAL flush; `dispatch_pending`
    makes decisions durable before it publishes them. A task that stopped being
    queued since it was read (a cancellation under way) is skipped and the
    decision made again, at most `RETRIES` times.
    """
    postgresql = session.get_bind().dialect.name == "postgresql"
    skipped: set[int] = set()
    for _ in range(RETRIES):
        free, head = (_read_postgresql if postgresql else _read)(session)
        if (fit := _first_fit(free, head, skipped)) is None:
            break
        if (task_id := allocate(session, *fit, free)) is not None:
            return task_id
        skipped.add(fit[0].id)
    session.rollback()
    return None


def _first_fit(
    free: dict[str, GroupFree], head: list[Queued], skipped: set[int]
) -> tuple[Queued, placement.Plan] | None:
    """The first task of the queue head that fits the free workers now, with its placement."""
    if not any(g.free for g in free.values()):
        return None
    for queued in head:
        if queued.id not in skipped:
            policy, previous = queued.spec.on_group_loss, queued.previous
            chosen = placement.plan(
                queued.spec.requested(), free, previous, migrate=policy != "wait"
            )
            if chosen is None and previous is not None and policy == "shrink":
                chosen = placement.survivors(previous, free, queued.spec)
            if chosen is not None:
                return queued, chosen
    return None


def schedule_once(
    session: Session,
    dispatcher: Dispatcher,
    *,
    heartbeat_timeout_s: float,
    interval_s: float = 1.0,
    watching_since: datetime | None = None,
) -> int:
    """One scheduler pass: detect failures, schedule what fits, publish messages.

    `watching_since` is when the scheduler started (naive UTC): no agent is
    timed out before it has had a full heartbeat timeout to reach it
    (`monitor.check`). Returns how many tasks were scheduled.
    """
    monitor.check(
        session, timeout_s=heartbeat_timeout_s, interval_s=interval_s, watching_since=watching_since
    )
    sweeps.advance_all(session)  # stop bad trials, submit the next ones (backend/sweeps)
    scheduled = 0
    while scheduled < MAX_PER_PASS and schedule_next(session) is not None:
        scheduled += 1
    dispatch.dispatch_pending(
        session, dispatcher, redispatch_after_s=max(30.0, 2 * heartbeat_timeout_s)
    )
    return scheduled
