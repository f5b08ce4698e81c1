"""Booking: one task's placement written as its nodes, sub-tasks and SCHEDULED event.

A task gets all of its nodes at once or none (gang allocation): the task
manager and the parameter server (rank 0) on its first group, and every
compute worker in each group, booked as parts across the group's serving agents
(one sub-task per part, for that agent). The status change QUEUED -> SCHEDULED and its
event row are the lifecycle's (:func:`backend.tasks.lifecycle.change`), written
as one guarded UPDATE so that a task no longer queued (a cancellation under
way) books nothing.

On PostgreSQL the claim with every node, sub-task and event insert is one
statement (data-modifying CTEs), pipelined with COMMIT. Elsewhere (SQLite,
whose writers are serialised) the same rows, laid out by the same
`_booking_layout`, through ordinary statements; a test checks both book the
same rows.
"""

import enum
from datetime import datetime
from typing import Any

from psycopg.types.json import Json
from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.util import identity_key

from backend.scheduler import placement
from backend.scheduler.capacity import GroupFree
from backend.scheduler.queue import QUEUE_FILTER, Queued
from backend.tasks import lifecycle
from backend.tasks.models import (
    Allocation,
    NodeRole,
    SubTask,
    SubTaskStatus,
    Task,
    TaskEvent,
    TaskStatus,
)
from contracts.plan import ps_ranks

# Book a task: a guarded UPDATE instead of SELECT ... FOR UPDATE then a flush. A task
# another transaction holds (a cancellation under way) is skipped, as is one no longer queued.
_CLAIM = (
    update(Task)
    .where(
        Task.id == bindparam("task_id"),
        Task.attempt == bindparam("task_attempt"),
        QUEUE_FILTER,
        Task.id.in_(
            select(Task.id).where(Task.id == bindparam("task_id")).with_for_update(skip_locked=True)
        ),
    )
    .values(
        status=bindparam("to_status"),
        status_reason=bindparam("reason"),
        spec=bindparam("new_spec", type_=Task.spec.type),
    )
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
    UPDATE task SET status = %(to_status)s, status_reason = %(reason)s,
                    spec = %(new_spec)s
    WHERE task.id = %(task_id)s AND task.attempt = %(task_attempt)s AND {QUEUE_FILTER.text}
      AND task.id IN (SELECT id FROM task WHERE id = %(task_id)s FOR UPDATE SKIP LOCKED)
    RETURNING task.id, task.attempt
), managers AS (
    INSERT INTO allocation (task_id, attempt, role, resource_group_id, rank, created_at)
    SELECT claimed.id, claimed.attempt, '{NodeRole.TASK_MANAGER.name}', %(first_group)s,
           NULL, %(now)s
    FROM claimed
), servers AS (
    INSERT INTO allocation (task_id, attempt, role, resource_group_id, rank, created_at)
    SELECT claimed.id, claimed.attempt, '{NodeRole.PARAMETER_SERVER.name}', %(first_group)s,
           node.rank, %(now)s
    FROM claimed, unnest(%(server_ranks)s::integer[]) AS node (rank)
), workers AS (
    INSERT INTO allocation (task_id, attempt, role, resource_group_id, rank, created_at)
    SELECT claimed.id, claimed.attempt, '{NodeRole.COMPUTE.name}', node.group_id, node.rank,
           %(now)s
    FROM claimed, unnest(%(worker_groups)s::integer[], %(worker_ranks)s::integer[])
         AS node (group_id, rank)
), sub_tasks AS (
    INSERT INTO sub_task (task_id, resource_group_id, group_index, part, first_rank, workers,
                          hosts_parameter_server, agent_id, attempt, status, detail,
                          updated_at)
    SELECT claimed.id, sub.group_id, sub.group_index, sub.part, sub.first_rank, sub.workers,
           sub.position = 1, sub.agent_id, claimed.attempt, '{SubTaskStatus.PENDING.name}',
           '', %(now)s
    FROM claimed, unnest(%(sub_groups)s::integer[], %(sub_indexes)s::integer[],
                         %(sub_parts)s::integer[], %(sub_first_ranks)s::integer[],
                         %(sub_workers)s::integer[], %(sub_agents)s::integer[])
         WITH ORDINALITY AS sub (group_id, group_index, part, first_rank, workers, agent_id,
                                 position)
), event AS (
    INSERT INTO task_event (task_id, from_status, to_status, reason, created_at, kind)
    SELECT claimed.id, %(from_status)s, %(to_status)s, %(reason)s, %(created_at)s, %(kind)s
    FROM claimed
)
SELECT id FROM claimed
"""


def allocate(
    session: Session, queued: Queued, chosen: placement.Plan, free: dict[str, GroupFree]
) -> int | None:
    """Book `chosen` for the task and commit; returns the task id, or None (rolled back) if
    the task is no longer queued.

    The caller holds the allocation lock since it read `free` and `queued`. The
    status change QUEUED -> SCHEDULED and its event row are the lifecycle's
    (:func:`backend.tasks.lifecycle.change`), written by one guarded UPDATE.
    """
    total = sum(p.workers for p in chosen)
    detail = ", ".join(f"{p.name}×{p.workers}" for p in chosen)
    scheduled = lifecycle.change(
        queued.id,
        TaskStatus.QUEUED,
        TaskStatus.SCHEDULED,
        f"attempt {queued.attempt}: allocated parameter server and {total} workers: {detail}",
    )
    if scheduled.has_side_effects or set(scheduled.task_values()) != {"status", "status_reason"}:
        # The statement below writes exactly these columns and nothing else: a lifecycle rule
        # that asks more of QUEUED -> SCHEDULED must be written here too.
        raise RuntimeError(f"booking cannot apply {scheduled}")
    claim = {
        **scheduled.event_row(),
        "task_attempt": queued.attempt,
        "new_spec": queued.spec.model_copy(update={"groups": chosen}).stored(),
    }
    layout = _booking_layout(chosen, free, now=scheduled.at, ps_shards=queued.spec.ps_shards or 1)
    if session.get_bind().dialect.name == "postgresql":
        task_id = _book_postgresql(session, {**claim, **layout})
        if (loaded := session.identity_map.get(identity_key(Task, queued.id))) is not None:
            session.expire(loaded)  # written behind the ORM: reload on next access
    elif task := session.scalars(_CLAIM, claim).one_or_none():
        _book(session, task, layout, scheduled)
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
    connection = driver(session)
    params = {
        key: value.name if isinstance(value, enum.Enum) else value  # stored by name
        for key, value in params.items()
    }
    params["new_spec"] = Json(params["new_spec"])
    with connection.cursor() as book, connection.cursor() as commit:
        with connection.pipeline():
            book.execute(_BOOK_PG, params, prepare=True)
            commit.execute("COMMIT")
        row = book.fetchone()
    return int(row[0]) if row else None


def _booking_layout(
    chosen: placement.Plan, fresh: dict[str, GroupFree], *, now: datetime, ps_shards: int = 1
) -> dict[str, Any]:
    """Where a booking's nodes and sub-tasks go (`_BOOK_PG`'s parameters; `_book` builds its
    rows from the same): the task manager and the parameter server (rank 0, and with
    `ps_shards` S > 1 the owners of its other shards, ranks W + 1 .. W + S - 1) on the first
    group, compute ranks 1 .. W group after group; each group's workers split into parts across
    its serving agents (`placement.parts`), one sub-task per part, ranks contiguous in part
    order; the first part of the first group hosts the parameter server."""
    ids = [fresh[item.name].id for item in chosen]
    workers = [item.workers for item in chosen]
    worker_groups = [g for g, n in zip(ids, workers, strict=True) for _ in range(n)]
    subs: dict[str, list[Any]] = {
        key: [] for key in ("groups", "indexes", "parts", "first_ranks", "workers", "agents")
    }
    rank = 1
    for index, item in enumerate(chosen):
        for part, (agent_id, count) in enumerate(placement.parts(item.workers, fresh[item.name])):
            for key, value in zip(
                subs, (ids[index], index, part, rank, count, agent_id), strict=True
            ):
                subs[key].append(value)
            rank += count
    return {
        "first_group": ids[0],
        "now": now,
        # The parameter server: rank 0 and its other shards' owners, after the workers.
        "server_ranks": ps_ranks(len(worker_groups), ps_shards),
        "worker_groups": worker_groups,
        "worker_ranks": list(range(1, len(worker_groups) + 1)),
        **{f"sub_{key}": values for key, values in subs.items()},
    }


def _book(
    session: Session, task: Task, layout: dict[str, Any], scheduled: lifecycle.Change
) -> None:
    """Insert the nodes, the sub-tasks and the SCHEDULED event laid out by `_booking_layout`."""
    now = layout["now"]
    base = {
        "task_id": task.id,
        "attempt": task.attempt,
        "created_at": now,
        "host": None,
        "last_heartbeat_at": None,
        "released_at": None,
    }
    first = layout["first_group"]
    nodes = [{**base, "role": NodeRole.TASK_MANAGER, "resource_group_id": first, "rank": None}]
    nodes += [
        {**base, "role": NodeRole.PARAMETER_SERVER, "resource_group_id": first, "rank": rank}
        for rank in layout["server_ranks"]
    ]
    nodes += [
        {**base, "role": NodeRole.COMPUTE, "resource_group_id": group_id, "rank": rank}
        for group_id, rank in zip(layout["worker_groups"], layout["worker_ranks"], strict=True)
    ]
    subs = [
        {
            "task_id": task.id,
            "resource_group_id": group_id,
            "group_index": index,
            "part": part,
            "first_rank": first_rank,
            "workers": workers,
            "hosts_parameter_server": position == 0,
            "attempt": task.attempt,
            "status": SubTaskStatus.PENDING,
            "detail": "",
            "agent_id": agent_id,
            "updated_at": now,
            "dispatched_at": None,
        }
        for position, (group_id, index, part, first_rank, workers, agent_id) in enumerate(
            zip(
                layout["sub_groups"],
                layout["sub_indexes"],
                layout["sub_parts"],
                layout["sub_first_ranks"],
                layout["sub_workers"],
                layout["sub_agents"],
                strict=True,
            )
        )
    ]
    connection = session.connection()
    connection.execute(_INSERT_NODES, nodes)
    connection.execute(_INSERT_SUBS, subs)
    connection.execute(_INSERT_EVENT, [scheduled.event_row()])


def driver(session: Session) -> Any:
    """The psycopg connection under the session's transaction."""
    connection = session.connection().connection.driver_connection
    assert connection is not None  # a checked-out connection
    return connection
