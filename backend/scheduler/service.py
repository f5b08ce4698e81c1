"""The scheduler: a priority queue, gang allocation, placement, first-level dispatch.

A decision takes the head of the queue (priority high first, then age; tasks
waiting on dependencies are not in it) through an index scan of at most
`WINDOW` tasks, never the whole queue. A task gets all of its nodes at once
or none (gang allocation): the task manager and the parameter server on its
first group, and every compute worker in each group. A decision holds the
allocation lock from reading free capacity to commit, so several schedulers
(threads or API processes) never book the same workers. Rank 0 is the
parameter server.

On PostgreSQL a decision is two round trips: the lock, capacity and queue
head as one psycopg pipeline; then the claim with every node, sub-task and
event insert as one statement (data-modifying CTEs), pipelined with COMMIT.
Elsewhere (SQLite, whose writers are serialised) the same rows, laid out by
the same `_booking_layout`, through ordinary statements; a test checks both
book the same rows.
"""

import logging
from dataclasses import dataclass
from datetime import datetime
from functools import cache, cached_property
from typing import Any

from psycopg.types.json import Json
from sqlalchemy import Text, bindparam, cast, func, insert, select, text, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.util import identity_key

from backend.core.db import utcnow
from backend.resource_groups import service as groups
from backend.resource_groups.service import GroupFree
from backend.scheduler import monitor, placement
from backend.scheduler.dispatch import Dispatcher
from backend.tasks.models import (
    Allocation,
    EventKind,
    NodeRole,
    SubTask,
    SubTaskStatus,
    Task,
    TaskEvent,
    TaskStatus,
)
from backend.tasks.spec import read_spec
from contracts.payload import SubTaskPayload, TaskLimits
from contracts.task_spec import TaskSpec

log = logging.getLogger(__name__)
WINDOW = 32  # queued tasks a decision looks at, at most
MAX_PER_PASS = 64  # tasks one pass schedules, at most
RETRIES = 3  # decisions made again after a task stopped being queued, at most
QUEUE_FILTER = text("task.status = 'QUEUED' AND NOT task.waiting")  # matches ix_task_queue


@dataclass(frozen=True)
class Queued:
    """What a decision reads of a queued task (not the whole row)."""

    id: int
    raw_spec: str  # decoded when the decision gets to this task (usually only the first)
    attempt: int

    @cached_property
    def spec(self) -> TaskSpec:
        return TaskSpec.model_validate_json(self.raw_spec)

    @property
    def previous(self) -> placement.Plan | None:
        """Where the last attempt ran (for a restart), else None."""
        return list(self.spec.groups) if self.attempt > 1 else None


_HEAD = (select(Task.id, cast(Task.spec, Text), Task.attempt).where(QUEUE_FILTER)
         .order_by(Task.priority.desc(), Task.id).limit(bindparam("limit")))
# PostgreSQL: the allocation lock, and an asynchronous commit for this transaction only
# (a decision is made durable before anything outside the database acts on it: see
# `monitor.dispatch_pending`). Plain index scans for the capacity join: they mark the
# entries of released allocations dead as they pass, a bitmap scan does not.
_BEGIN_PG = select(func.set_config("synchronous_commit", "off", True),
                   func.set_config("enable_bitmapscan", "off", True),
                   func.pg_advisory_xact_lock(groups.ALLOCATION_LOCK))
# Book a task: a guarded UPDATE instead of SELECT ... FOR UPDATE then a flush. A task
# another transaction holds (a cancellation under way) is skipped, as is one no longer queued.
_CLAIM = (
    update(Task)
    .where(Task.id == bindparam("task_id"), Task.attempt == bindparam("task_attempt"),
           QUEUE_FILTER,
           Task.id.in_(select(Task.id).where(Task.id == bindparam("task_id"))
                       .with_for_update(skip_locked=True)))
    .values(status=TaskStatus.SCHEDULED, status_reason=bindparam("reason"),
            spec=bindparam("new_spec", type_=Task.spec.type))
    .returning(Task)
    .execution_options(synchronize_session=False, populate_existing=True)
)

# `inline`: no RETURNING of generated keys (executemany of one cached statement).
_INSERT_NODES = insert(Allocation).inline()
_INSERT_SUBS = insert(SubTask).inline()
_INSERT_EVENT = insert(TaskEvent).inline()


# PostgreSQL: the claim and every insert of a booking in one statement (data-modifying CTEs,
# each insert driven by the claimed row, so a task no longer queued books nothing). Driver
# SQL: enum columns hold the member's name (`_enum` in tasks.models).
_BOOK_PG = f"""
WITH claimed AS (
    UPDATE task SET status = '{TaskStatus.SCHEDULED.name}', status_reason = %(reason)s,
                    spec = %(new_spec)s
    WHERE task.id = %(task_id)s AND task.attempt = %(task_attempt)s AND {QUEUE_FILTER.text}
      AND task.id IN (SELECT id FROM task WHERE id = %(task_id)s FOR UPDATE SKIP LOCKED)
    RETURNING task.id, task.attempt
), managers AS (
    INSERT INTO allocation (task_id, attempt, role, resource_group_id, rank, created_at)
    SELECT claimed.id, claimed.attempt, node.role, %(first_group)s, node.rank, %(now)s
    FROM claimed, (VALUES ('{NodeRole.TASK_MANAGER.name}', CAST(NULL AS INTEGER)),
                          ('{NodeRole.PARAMETER_SERVER.name}', 0)) AS node (role, rank)
), workers AS (
    INSERT INTO allocation (task_id, attempt, role, resource_group_id, rank, created_at)
    SELECT claimed.id, claimed.attempt, '{NodeRole.COMPUTE.name}', node.group_id, node.rank,
           %(now)s
    FROM claimed, unnest(%(worker_groups)s::integer[], %(worker_ranks)s::integer[])
         AS node (group_id, rank)
), sub_tasks AS (
    INSERT INTO sub_task (task_id, resource_group_id, group_index, workers,
                          hosts_parameter_server, attempt, status, detail, updated_at)
    SELECT claimed.id, sub.group_id, sub.position - 1, sub.workers, sub.position = 1,
           claimed.attempt, '{SubTaskStatus.PENDING.name}', '', %(now)s
    FROM claimed, unnest(%(sub_groups)s::integer[], %(sub_workers)s::integer[])
         WITH ORDINALITY AS sub (group_id, workers, position)
), event AS (
    INSERT INTO task_event (task_id, from_status, to_status, reason, created_at, kind)
    SELECT claimed.id, '{TaskStatus.QUEUED.name}', '{TaskStatus.SCHEDULED.name}', %(reason)s,
           %(now)s, '{EventKind.STATUS.name}'
    FROM claimed
)
SELECT id FROM claimed
"""


def queue_head(session: Session, *, limit: int = WINDOW) -> list[Queued]:
    """The first `limit` runnable queued tasks: priority high first, then oldest."""
    rows = session.connection().execute(_HEAD, {"limit": limit})
    return [Queued(*row) for row in rows]


def _read(session: Session) -> tuple[dict[str, GroupFree], list[Queued]]:
    """Free capacity and the queue head under the allocation lock (any database)."""
    groups.lock_allocation(session)
    free = groups.free_capacity(session)
    return free, (queue_head(session) if any(g.free for g in free.values()) else [])


def _compiled(statement: Any, dialect: Any) -> str:
    return str(statement.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))


@cache
def _pipelined_reads(dialect: Any) -> tuple[str, str, str]:
    """The lock, capacity and queue-head statements as the driver's SQL (compiled once)."""
    return (_compiled(_BEGIN_PG, dialect), _compiled(groups.FREE, dialect),
            _compiled(_HEAD.limit(WINDOW), dialect))


def _driver(session: Session) -> Any:
    """The psycopg connection under the session's transaction."""
    driver = session.connection().connection.driver_connection
    assert driver is not None  # a checked-out connection
    return driver


def _read_postgresql(session: Session) -> tuple[dict[str, GroupFree], list[Queued]]:
    """`_read` in one round trip: BEGIN, the lock, capacity and queue head sent as one psycopg
    pipeline. PostgreSQL runs them in order and takes a new snapshot per statement, so the
    reads see every allocation committed before the lock was granted."""
    lock_sql, free_sql, head_sql = _pipelined_reads(session.get_bind().dialect)
    driver = _driver(session)
    with driver.cursor() as lock, driver.cursor() as free, driver.cursor() as head:
        # Sent, and every result read, at the block's end. Prepared: planned once per
        # connection (planning the capacity join costs more than running it).
        with driver.pipeline():
            lock.execute(lock_sql, prepare=True)
            free.execute(free_sql, prepare=True)
            head.execute(head_sql, prepare=True)
        return (groups.free_from_rows(free.fetchall()),
                [Queued(*row) for row in head.fetchall()])


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


def _first_fit(free: dict[str, GroupFree], head: list[Queued], skipped: set[int]
               ) -> tuple[Queued, placement.Plan] | None:
    """The first task of the queue head that fits the free workers now, with its placement."""
    if not any(g.free for g in free.values()):
        return None
    for queued in head:
        if queued.id not in skipped:
            chosen = placement.plan(queued.spec.requested(), free, queued.previous)
            if chosen is not None:
                return queued, chosen
    return None


def allocate(session: Session, queued: Queued, chosen: placement.Plan,
             free: dict[str, GroupFree]) -> int | None:
    """Book `chosen` for the task and commit; returns the task id, or None (rolled back) if
    the task is no longer queued.

    The caller holds the allocation lock since it read `free` and `queued`. The
    status change QUEUED -> SCHEDULED is the lifecycle's (an allowed transition
    and its event), done as one guarded UPDATE.
    """
    total = sum(p.workers for p in chosen)
    detail = ", ".join(f"{p.name}×{p.workers}" for p in chosen)
    reason = (f"attempt {queued.attempt}: allocated parameter server and {total} "
              f"workers: {detail}")
    claim = {"task_id": queued.id, "task_attempt": queued.attempt, "reason": reason,
             "new_spec": queued.spec.model_copy(update={"groups": chosen}).stored()}
    if session.get_bind().dialect.name == "postgresql":
        task_id = _book_postgresql(session, {**claim, **_booking_layout(chosen, free)})
        if (loaded := session.identity_map.get(identity_key(Task, queued.id))) is not None:
            session.expire(loaded)  # written behind the ORM: reload on next access
    elif task := session.scalars(_CLAIM, claim).one_or_none():
        _book(session, task, _booking_layout(chosen, free), reason)
        task_id = task.id
    else:
        task_id = None
    if task_id is None:
        session.rollback()
        return None
    session.commit()
    return task_id


def _book_postgresql(session: Session, params: dict[str, Any]) -> int | None:
    """`_BOOK_PG` and COMMIT in one psycopg pipeline (one round trip); the task id or None.

    A task no longer queued books nothing, so committing regardless is safe; the
    caller's `session.commit()` then finds the transaction ended (no round trip).
    """
    driver = _driver(session)
    params["new_spec"] = Json(params["new_spec"])
    with driver.cursor() as book, driver.cursor() as commit:
        with driver.pipeline():
            book.execute(_BOOK_PG, params, prepare=True)
            commit.execute("COMMIT")
        row = book.fetchone()
    return int(row[0]) if row else None


def _booking_layout(chosen: placement.Plan, fresh: dict[str, GroupFree]) -> dict[str, Any]:
    """Where a booking's nodes and sub-tasks go (`_BOOK_PG`'s parameters; `_book` builds its
    rows from the same): the task manager and the parameter server (rank 0) on the first
    group, compute ranks 1.. group after group, one sub-task per group in plan order."""
    ids = [fresh[item.name].id for item in chosen]
    workers = [item.workers for item in chosen]
    worker_groups = [g for g, n in zip(ids, workers, strict=True) for _ in range(n)]
    return {"first_group": ids[0], "now": utcnow(), "worker_groups": worker_groups,
            "worker_ranks": list(range(1, len(worker_groups) + 1)),
            "sub_groups": ids, "sub_workers": workers}


def _book(session: Session, task: Task, layout: dict[str, Any], reason: str) -> None:
    """Insert the nodes, the sub-tasks and the SCHEDULED event laid out by `_booking_layout`."""
    now = layout["now"]
    base = {"task_id": task.id, "attempt": task.attempt, "created_at": now,
            "host": None, "last_heartbeat_at": None, "released_at": None}
    first = layout["first_group"]
    nodes = [{**base, "role": NodeRole.TASK_MANAGER, "resource_group_id": first, "rank": None},
             {**base, "role": NodeRole.PARAMETER_SERVER, "resource_group_id": first, "rank": 0}]
    nodes += [{**base, "role": NodeRole.COMPUTE, "resource_group_id": group_id, "rank": rank}
              for group_id, rank in zip(layout["worker_groups"], layout["worker_ranks"],
                                        strict=True)]
    subs = [{"task_id": task.id, "resource_group_id": group_id, "group_index": index,
             "workers": workers, "hosts_parameter_server": index == 0,
             "attempt": task.attempt, "status": SubTaskStatus.PENDING, "detail": "",
             "agent_id": None, "updated_at": now, "dispatched_at": None}
            for index, (group_id, workers) in enumerate(
                zip(layout["sub_groups"], layout["sub_workers"], strict=True))]
    event = [{"task_id": task.id, "from_status": TaskStatus.QUEUED,
              "to_status": TaskStatus.SCHEDULED, "reason": reason, "created_at": now,
              "kind": EventKind.STATUS}]
    connection = session.connection()
    connection.execute(_INSERT_NODES, nodes)
    connection.execute(_INSERT_SUBS, subs)
    connection.execute(_INSERT_EVENT, event)


def engine_options(spec: TaskSpec) -> dict[str, Any]:
    """The engine options of a task's spec; a quorum above the placed groups means all groups."""
    return spec.engine_options()


def payload_for(task: Task, sub: SubTask, *, resume_checkpoint_id: int | None = None
                ) -> SubTaskPayload:
    spec = read_spec(task)
    if spec.epochs is None or spec.global_batch_size is None:
        raise ValueError(f"task {task.id}'s spec has no epochs or global batch size")
    groups = [g.model_copy(update={"speed_factor": spec.speed_factor(g)}) for g in spec.groups]
    return SubTaskPayload(
        task_id=task.id, sub_task_id=sub.id, group_index=sub.group_index,
        hosts_parameter_server=sub.hosts_parameter_server, epochs=spec.epochs,
        global_batch_size=spec.global_batch_size, seed=spec.seed,
        split_policy=spec.split_policy, groups=groups, engine=engine_options(spec),
        attempt=sub.attempt, resume_checkpoint_id=resume_checkpoint_id,
        limits=spec.limits or TaskLimits(),
    )


def schedule_once(session: Session, dispatcher: Dispatcher, *, heartbeat_timeout_s: float,
                  interval_s: float = 1.0, watching_since: datetime | None = None) -> int:
    """One scheduler pass: detect failures, schedule what fits, publish messages.

    `watching_since` is when the scheduler started (naive UTC): no agent is
    timed out before it has had a full heartbeat timeout to reach it
    (`monitor.check`). Returns how many tasks were scheduled.
    """
    monitor.check(session, timeout_s=heartbeat_timeout_s, interval_s=interval_s,
                  watching_since=watching_since)
    scheduled = 0
    while scheduled < MAX_PER_PASS and schedule_next(session) is not None:
        scheduled += 1
    monitor.dispatch_pending(session, dispatcher, payload_for,
                             redispatch_after_s=max(30.0, 2 * heartbeat_timeout_s))
    return scheduled
