"""The scheduler: a priority queue, gang allocation, placement, first-level dispatch.

A decision takes the head of the queue (priority high first, then age; tasks
waiting on dependencies are not in it) through an index scan of at most
`WINDOW` tasks, never the whole queue. A task gets all of its nodes at once
or none (gang allocation): the task manager and the parameter server on its
first group, and every compute worker in each group. A decision holds the
allocation lock from reading free capacity to commit, so several schedulers
(threads or API processes) never book the same workers. Rank 0 is the
parameter server.
"""

import json
import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from sqlalchemy import Connection, Text, bindparam, cast, func, insert, select, text, update
from sqlalchemy.orm import Session

from backend.core.db import utcnow
from backend.resource_groups import service as groups
from backend.resource_groups.service import GroupFree
from backend.scheduler import monitor, placement
from backend.scheduler.dispatch import Dispatcher
from backend.scheduler.payload import GroupPlan, SubTaskPayload
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

log = logging.getLogger(__name__)
WINDOW = 32  # queued tasks a decision looks at, at most
MAX_PER_PASS = 64  # tasks one pass schedules, at most
QUEUE_FILTER = text("task.status = 'QUEUED' AND NOT task.waiting")  # matches ix_task_queue


@dataclass(frozen=True)
class Queued:
    """What a decision reads of a queued task (not the whole row)."""

    id: int
    raw_spec: str  # decoded when the decision gets to this task (usually only the first)
    attempt: int

    @cached_property
    def spec(self) -> dict[str, Any]:
        return json.loads(self.raw_spec)

    @property
    def previous(self) -> placement.Plan | None:
        """Where the last attempt ran (for a restart), else None."""
        return list(self.spec.get("groups") or []) if self.attempt > 1 else None


_HEAD = (select(Task.id, cast(Task.spec, Text), Task.attempt).where(QUEUE_FILTER)
         .order_by(Task.priority.desc(), Task.id).limit(bindparam("limit")))
# PostgreSQL: the allocation lock, and an asynchronous commit for this transaction only
# (a decision is made durable before anything outside the database acts on it: see
# `monitor.dispatch_pending`). One statement, one round trip.
_BEGIN_PG = select(func.set_config("synchronous_commit", "off", True),
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

# `inline`: no RETURNING of generated keys, so they run inside a pipeline even for one row.
_INSERT_NODES = insert(Allocation).inline()
_INSERT_SUBS = insert(SubTask).inline()
_INSERT_EVENT = insert(TaskEvent).inline()


def queue_head(session: Session, *, limit: int = WINDOW) -> list[Queued]:
    """The first `limit` runnable queued tasks: priority high first, then oldest."""
    rows = session.connection().execute(_HEAD, {"limit": limit})
    return [Queued(*row) for row in rows]


def _begin_decision(session: Session) -> None:
    """Take the allocation lock until the transaction ends (see `groups.lock_allocation`)."""
    if session.get_bind().dialect.name == "postgresql":
        session.connection().execute(_BEGIN_PG)


def schedule_next(session: Session) -> Task | None:
    """One scheduling decision: allocate the first queued task that fits now, if any.

    Returns the scheduled task (committed, not yet dispatched) or None. On
    PostgreSQL the commit does not wait for the WAL flush; `dispatch_pending`
    makes decisions durable before it publishes them.
    """
    _begin_decision(session)
    free = groups.free_capacity(session)
    if any(g.free for g in free.values()):
        for queued in queue_head(session):
            chosen = placement.plan(placement.request_of(queued.spec), free, queued.previous)
            if chosen is not None and (task := allocate(session, queued, chosen, free)):
                return task
    session.rollback()
    return None


def allocate(session: Session, queued: Queued, chosen: placement.Plan,
             free: dict[str, GroupFree]) -> Task | None:
    """Book `chosen` for the task and commit; None if the task is no longer queued.

    The caller holds the allocation lock since it read `free` and `queued`. The
    status change QUEUED -> SCHEDULED is the lifecycle's (an allowed transition
    and its event), done as one guarded UPDATE.
    """
    total = sum(p["workers"] for p in chosen)
    detail = ", ".join(f"{p['name']}×{p['workers']}" for p in chosen)
    reason = (f"attempt {queued.attempt}: allocated parameter server and {total} "
              f"workers: {detail}")
    task = session.scalars(_CLAIM, {"task_id": queued.id, "task_attempt": queued.attempt,
                                     "reason": reason,
                                     "new_spec": {**queued.spec, "groups": chosen}}
                           ).one_or_none()
    if task is None:
        return None
    _book(session, task, chosen, free, reason)
    session.commit()
    return task


def _book(session: Session, task: Task, chosen: placement.Plan,
          fresh: dict[str, GroupFree], reason: str) -> None:
    """Insert the nodes (rank 0 = parameter server on the first group), the sub-tasks and
    the SCHEDULED event."""
    first, now = fresh[chosen[0]["name"]].id, utcnow()
    base = {"task_id": task.id, "attempt": task.attempt, "created_at": now,
            "host": None, "last_heartbeat_at": None, "released_at": None}
    nodes = [{**base, "role": NodeRole.TASK_MANAGER, "resource_group_id": first, "rank": None},
             {**base, "role": NodeRole.PARAMETER_SERVER, "resource_group_id": first, "rank": 0}]
    subs, rank = [], 1
    for index, item in enumerate(chosen):
        group_id = fresh[item["name"]].id
        nodes += [{**base, "role": NodeRole.COMPUTE, "resource_group_id": group_id,
                   "rank": rank + i} for i in range(item["workers"])]
        rank += item["workers"]
        subs.append({"task_id": task.id, "resource_group_id": group_id, "group_index": index,
                     "workers": item["workers"], "hosts_parameter_server": index == 0,
                     "attempt": task.attempt, "status": SubTaskStatus.PENDING, "detail": "",
                     "agent_id": None, "updated_at": now, "dispatched_at": None})
    event = [{"task_id": task.id, "from_status": TaskStatus.QUEUED,
              "to_status": TaskStatus.SCHEDULED, "reason": reason, "created_at": now,
              "kind": EventKind.STATUS}]
    # Core executemany of cached statements; on PostgreSQL all three in one pipeline (one
    # round trip; psycopg's executemany rides an open pipeline).
    connection = session.connection()
    with _pipeline(connection):
        connection.execute(_INSERT_NODES, nodes)
        connection.execute(_INSERT_SUBS, subs)
        connection.execute(_INSERT_EVENT, event)


def _pipeline(connection: Connection) -> AbstractContextManager[Any]:
    """psycopg's pipeline mode on PostgreSQL (statements sent without waiting for each
    result; for statements that return no rows), else nothing."""
    driver = connection.connection.driver_connection
    return driver.pipeline() if hasattr(driver, "pipeline") else nullcontext()


ENGINE_OPTIONS = ("sync_strategy", "sync_period", "quorum", "max_staleness",
                  "exchange_fraction", "checkpoint_every", "rebalance_every", "preprocess")


def _speed_factor(spec: dict[str, Any], group: dict[str, Any]) -> float:
    """A placed group's emulated speed factor: from the request item naming it, else from a
    device-type item of its device type, else 1.0 (e.g. after a move to another group)."""
    if "speed_factor" in group:
        return float(group["speed_factor"])
    items = spec.get("request") or []
    for item in items:
        if item.get("name") == group["name"]:
            return float(item.get("speed_factor", 1.0))
    for item in items:
        if not item.get("name") and item.get("device_type") == group["device_type"]:
            return float(item.get("speed_factor", 1.0))
    return 1.0


def engine_options(spec: dict[str, Any]) -> dict[str, Any]:
    """The engine options of a task's spec; a quorum above the placed groups means all groups."""
    options = {k: spec[k] for k in ENGINE_OPTIONS if spec.get(k) is not None}
    if "quorum" in options:
        options["quorum"] = min(int(options["quorum"]), len(spec["groups"]))
    return options


def payload_for(task: Task, sub: SubTask, *, resume_checkpoint_id: int | None = None
                ) -> SubTaskPayload:
    spec: dict[str, Any] = task.spec
    groups = [GroupPlan(**{**g, "speed_factor": _speed_factor(spec, g)}) for g in spec["groups"]]
    return SubTaskPayload(
        task_id=task.id, sub_task_id=sub.id, group_index=sub.group_index,
        hosts_parameter_server=sub.hosts_parameter_server, epochs=spec["epochs"],
        global_batch_size=spec["global_batch_size"], seed=spec["seed"],
        split_policy=spec["split_policy"], groups=groups, engine=engine_options(spec),
        attempt=sub.attempt, resume_checkpoint_id=resume_checkpoint_id,
    )


def schedule_once(session: Session, dispatcher: Dispatcher, *, heartbeat_timeout_s: float,
                  interval_s: float = 1.0) -> int:
    """One scheduler pass: detect failures, schedule what fits, publish messages.

    Returns how many tasks were scheduled.
    """
    monitor.check(session, timeout_s=heartbeat_timeout_s, interval_s=interval_s)
    scheduled = 0
    while scheduled < MAX_PER_PASS and schedule_next(session) is not None:
        scheduled += 1
    monitor.dispatch_pending(session, dispatcher, payload_for,
                             redispatch_after_s=max(30.0, 2 * heartbeat_timeout_s))
    return scheduled
