"""The scheduler: gang allocation of queued tasks and first-level dispatch.

A task gets all of its nodes at once or none (gang allocation): the task
manager and the parameter server on its first group, and every compute
worker it asked for in each group. Rank 0 is the parameter server.
"""

import logging
from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from backend.agents.models import Agent
from backend.core.db import utcnow
from backend.resource_groups import service as groups
from backend.resource_groups.models import ResourceGroup
from backend.scheduler.dispatch import Dispatcher
from backend.scheduler.payload import GroupPlan, SubTaskPayload
from backend.tasks import lifecycle
from backend.tasks.models import Allocation, NodeRole, SubTask, SubTaskStatus, Task, TaskStatus

log = logging.getLogger(__name__)


def mark_stale_agents(session: Session, *, timeout_s: float) -> int:
    """Mark agents whose last heartbeat is older than `timeout_s` seconds offline."""
    cutoff = utcnow() - timedelta(seconds=timeout_s)
    result = session.execute(
        update(Agent).where(Agent.online.is_(True), Agent.last_heartbeat_at < cutoff)
        .values(online=False)
    )
    session.commit()
    return result.rowcount or 0  # type: ignore[attr-defined]


def free_workers(session: Session, group: ResourceGroup) -> int:
    """Workers the group can start now: online agents' slots, capped by capacity, less held."""
    online = sum(a.workers for a in groups.online_agents(session, group_id=group.id))
    return min(group.capacity, online) - groups.allocated_workers(session, group_id=group.id)


def _fits(session: Session, task: Task) -> list[ResourceGroup] | None:
    found = []
    for plan in task.spec["groups"]:
        group = session.scalar(select(ResourceGroup).where(ResourceGroup.name == plan["name"]))
        if group is None or free_workers(session, group) < plan["workers"]:
            return None
        found.append(group)
    return found


def _allocate(session: Session, task: Task, placed: list[ResourceGroup]) -> list[SubTask]:
    first = placed[0].id
    session.add(Allocation(task_id=task.id, role=NodeRole.TASK_MANAGER, resource_group_id=first))
    session.add(Allocation(task_id=task.id, role=NodeRole.PARAMETER_SERVER,
                           resource_group_id=first, rank=0))
    rank, subs = 1, []
    for index, (group, plan) in enumerate(zip(placed, task.spec["groups"], strict=True)):
        for _ in range(plan["workers"]):
            session.add(Allocation(task_id=task.id, role=NodeRole.COMPUTE,
                                   resource_group_id=group.id, rank=rank))
            rank += 1
        sub = SubTask(task_id=task.id, resource_group_id=group.id, group_index=index,
                      workers=plan["workers"], hosts_parameter_server=index == 0)
        session.add(sub)
        subs.append(sub)
    return subs


def payload_for(task: Task, sub: SubTask) -> SubTaskPayload:
    spec = task.spec
    return SubTaskPayload(
        task_id=task.id, sub_task_id=sub.id, group_index=sub.group_index,
        hosts_parameter_server=sub.hosts_parameter_server, epochs=spec["epochs"],
        global_batch_size=spec["global_batch_size"], seed=spec["seed"],
        split_policy=spec["split_policy"], groups=[GroupPlan(**g) for g in spec["groups"]],
    )


def try_schedule(session: Session, task: Task, dispatcher: Dispatcher) -> bool:
    """Allocate and dispatch `task` if every group has room now; False if it waits."""
    placed = _fits(session, task)
    if placed is None:
        return False
    subs = _allocate(session, task, placed)
    session.flush()
    total = sum(s.workers for s in subs)
    names = ", ".join(f"{g.name}×{s.workers}" for g, s in zip(placed, subs, strict=True))
    lifecycle.transition(session, task, TaskStatus.SCHEDULED,
                         f"allocated parameter server and {total} workers: {names}")
    session.commit()
    for sub in subs:
        dispatcher.send(payload_for(task, sub))
    return True


def fail_orphaned(session: Session) -> None:
    """Fail running tasks whose agent went offline (restart comes with fault tolerance)."""
    rows = session.execute(
        select(Task, Agent).join(SubTask, SubTask.task_id == Task.id)
        .join(Agent, Agent.id == SubTask.agent_id)
        .where(Task.status.in_([TaskStatus.SCHEDULED, TaskStatus.RUNNING]),
               SubTask.status == SubTaskStatus.RUNNING, Agent.online.is_(False))
    ).all()
    for task, agent in rows:
        if not task.status.terminal:
            lifecycle.transition(session, task, TaskStatus.FAILED,
                                 f"agent '{agent.name}' stopped sending heartbeats")
    session.commit()


def schedule_once(session: Session, dispatcher: Dispatcher, *, heartbeat_timeout_s: float) -> int:
    """One scheduler pass; returns how many tasks were dispatched.

    Queued tasks are taken by priority (high first), then age.
    """
    mark_stale_agents(session, timeout_s=heartbeat_timeout_s)
    fail_orphaned(session)
    queued = session.scalars(
        select(Task).where(Task.status == TaskStatus.QUEUED)
        .order_by(Task.priority.desc(), Task.id).limit(100)
    ).all()
    return sum(try_schedule(session, task, dispatcher) for task in queued)
