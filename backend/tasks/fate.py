"""A task's fate from what its agents report: claims, finished groups, a restarted agent.

Next to the lifecycle (:mod:`backend.tasks.lifecycle`), which makes every status
change these decisions call for. The agents' transport (``backend.agent_api``)
calls these functions and nothing else decides whether a task succeeds, fails
or restarts.
"""

from sqlalchemy import ColumnElement, func, select, update
from sqlalchemy.orm import Session

from backend.agents.models import Agent, AgentState
from backend.core.errors import Conflict, NotFound
from backend.tasks import lifecycle
from backend.tasks.models import (
    ACTIVE,
    Allocation,
    EventKind,
    NodeRole,
    SubTask,
    SubTaskStatus,
    Task,
    TaskStatus,
)
from contracts.agent_api import Claim, Finished, Ready, Rendezvous


def get_sub_task(session: Session, *, sub_task_id: int) -> SubTask:
    sub = session.get(SubTask, sub_task_id)
    if sub is None:
        raise NotFound(f"sub-task {sub_task_id} does not exist")
    return sub


def claim(session: Session, *, sub: SubTask, data: Claim) -> SubTask:
    """An agent takes a sub-task (its group's part booked for that agent). A redelivered
    message finds it taken: Conflict.

    A message of an earlier attempt (the task restarted since) is refused too. A retry of
    a claim that was taken (the same `data.claim_id`, agent and attempt: its answer was
    lost) is answered as it was, changing nothing, while the part still runs.
    The first claim moves the task from SCHEDULED to RUNNING, unless the claiming agent
    prepares first (`data.preparing`: it builds the code version's environment): then the
    part waits in `preparing`, the timeline records the phase, and :func:`ready` starts the
    task once no part of its attempt prepares any more. Only an active
    agent of the part's group claims it, and only the agent it is booked for (a
    part booked for none, after its agent could not take it, goes to any). A claim
    that would make the agent run more workers than its `workers` is refused. An
    agent an admin drained or disabled, or one short of free workers, hands the part
    back: it is booked for another agent of the group at the scheduler's next pass
    (:func:`backend.scheduler.dispatch.rebook_parts`) and published again.

    Raises:
        NotFound: `data.agent_id` names no registered agent.
        Conflict: (field `agent_id`) the agent is not active, serves another group, or
            the part is booked for another agent; (field `workers`) the agent runs too
            many workers to take the part; (no field) the sub-task is taken or of
            another attempt.
    """
    agent = session.get(Agent, data.agent_id)
    if agent is None:
        raise NotFound(f"agent {data.agent_id} is not registered", field="agent_id")
    task = session.get_one(Task, sub.task_id, with_for_update=True)
    # Read the part again under the task's lock: a claim of it that committed while this
    # one waited (this very claim, its answer lost and retried) must be seen as it is now.
    session.refresh(sub)
    retried = data.claim_id is not None and (sub.claim_id, sub.agent_id, sub.attempt) == (
        data.claim_id,
        data.agent_id,
        data.attempt,
    )
    if retried and sub.status is SubTaskStatus.RUNNING and task.status.active:
        return sub  # this very claim, retried: it was taken, its answer was lost
    if (
        sub.status is not SubTaskStatus.PENDING
        or not task.status.active
        or sub.attempt != task.attempt
        or data.attempt != sub.attempt
    ):
        raise Conflict(
            f"sub-task {sub.id} (attempt {sub.attempt}) is {sub.status.value}; "
            f"task is {task.status.value} in attempt {task.attempt}"
        )
    if agent.resource_group_id != sub.resource_group_id:
        raise Conflict(
            f"agent '{agent.name}' serves another resource group (id {agent.resource_group_id}) "
            f"than sub-task {sub.id} (id {sub.resource_group_id})",
            field="agent_id",
        )
    if agent.state is not AgentState.ACTIVE:
        _hand_back(session, sub, agent)
        raise Conflict(
            f"agent '{agent.name}' is {agent.state.value}: it takes no new sub-tasks",
            field="agent_id",
        )
    if sub.agent_id is not None and sub.agent_id != agent.id:
        raise Conflict(
            f"sub-task {sub.id} is booked for agent {sub.agent_id}, not '{agent.name}'",
            field="agent_id",
        )
    running = running_workers(session, agent_id=agent.id)
    if running + sub.workers > agent.workers:
        _hand_back(session, sub, agent)
        raise Conflict(
            f"agent '{agent.name}' has workers={agent.workers} and runs {running}: "
            f"{sub.workers} more would oversubscribe its host",
            field="workers",
        )
    lifecycle.move_sub_task(sub, SubTaskStatus.RUNNING)
    sub.agent_id, sub.preparing, sub.claim_id = data.agent_id, data.preparing, data.claim_id
    nodes = (Allocation.role == NodeRole.COMPUTE) & Allocation.rank.between(
        sub.first_rank, sub.first_rank + sub.workers - 1
    )
    if sub.hosts_parameter_server:
        nodes |= Allocation.role.in_([NodeRole.PARAMETER_SERVER, NodeRole.TASK_MANAGER])
    session.execute(
        update(Allocation)
        .where(
            Allocation.task_id == task.id,
            Allocation.attempt == sub.attempt,
            Allocation.resource_group_id == sub.resource_group_id,
            nodes,
        )
        .values(host=data.host)
    )
    if data.preparing:
        lifecycle.alarm(
            session,
            task,
            f"agent on {data.host} prepares group {sub.group_index} part {sub.part}: "
            "building the code version's environment",
            kind=EventKind.PHASE,
        )
    else:
        _start(session, task, sub, f"agent on {data.host} started")
    session.commit()
    return sub


def ready(session: Session, *, sub: SubTask, data: Ready) -> SubTask:
    """A preparing part's agent has built the environment (`data.detail`: how long it took,
    or that it was cached) and starts its ranks. The phase's end goes on the timeline; the
    task moves from SCHEDULED to RUNNING when no other part of its attempt still prepares.

    Raises:
        Conflict: the part is not a claimed, preparing part of the task's current attempt.
    """
    task = session.get_one(Task, sub.task_id, with_for_update=True)
    if (
        sub.status is not SubTaskStatus.RUNNING
        or not sub.preparing
        or sub.attempt != task.attempt
        or not task.status.active
    ):
        raise Conflict(
            f"sub-task {sub.id} (attempt {sub.attempt}, {sub.status.value}) is not preparing; "
            f"task is {task.status.value} in attempt {task.attempt}"
        )
    sub.preparing = False
    done = f"group {sub.group_index} part {sub.part} prepared"
    lifecycle.alarm(
        session, task, f"{done}: {data.detail}" if data.detail else done, kind=EventKind.PHASE
    )
    _start(session, task, sub, "environment ready on every part: agent", every_part=True)
    session.commit()
    return sub


def _start(
    session: Session, task: Task, sub: SubTask, who: str, *, every_part: bool = False
) -> None:
    """Move a SCHEDULED task to RUNNING, unless a claimed part of its attempt still prepares
    or, with `every_part` (a task with an environment: each part prepares it), a part is not
    claimed yet, since it will prepare too."""
    if task.status is not TaskStatus.SCHEDULED:
        return
    session.flush()
    # On SQLite FOR UPDATE locks nothing, and the task was read before this transaction
    # began: another part's claim may have moved it since (the timeline showed RUNNING
    # twice). The flush took the database's write lock, so the status read again now is the
    # committed one; on PostgreSQL the row lock already made it so.
    session.refresh(task, attribute_names=["status"])
    if task.status is not TaskStatus.SCHEDULED:
        return
    waiting: ColumnElement[bool] = SubTask.preparing.is_(True)
    if every_part:
        waiting |= SubTask.status == SubTaskStatus.PENDING
    held_back = session.scalar(
        select(func.count())
        .select_from(SubTask)
        .where(SubTask.task_id == task.id, SubTask.attempt == task.attempt, waiting)
    )
    if not held_back:
        lifecycle.transition(
            session,
            task,
            TaskStatus.RUNNING,
            f"{who} group {sub.group_index} part {sub.part}",
        )


def _hand_back(session: Session, sub: SubTask, agent: Agent) -> None:
    """Unbook an unclaimed part from `agent`, which cannot take it, for the scheduler to book
    for another agent of its group and publish again (commits)."""
    if sub.status is SubTaskStatus.PENDING and sub.agent_id in (None, agent.id):
        sub.agent_id, sub.dispatched_at = None, None
        session.commit()


def running_workers(session: Session, *, agent_id: int) -> int:
    """Compute workers agent `agent_id` runs now: its claimed parts of active tasks' current
    attempts."""
    return (
        session.scalar(
            select(func.sum(SubTask.workers))
            .join(Task, Task.id == SubTask.task_id)
            .where(*running_on(agent_id))
        )
        or 0
    )


def set_rendezvous(session: Session, *, task: Task, data: Rendezvous) -> None:
    """Publish the parameter server's address for the task's current attempt.

    Raises:
        Conflict: `data` is of another attempt (the task restarted since).
    """
    if data.attempt != task.attempt:
        raise Conflict(f"task {task.id} is in attempt {task.attempt}, not {data.attempt}")
    task.master_addr, task.master_port = data.master_addr, data.master_port
    session.commit()


def peer_hosts(session: Session, task: Task) -> tuple[list[str], bool]:
    """The hosts the agents of `task`'s current attempt claimed its sub-tasks from (sorted),
    and whether every sub-task of the attempt is claimed."""
    hosts = session.scalars(
        select(Allocation.host)
        .where(
            Allocation.task_id == task.id,
            Allocation.attempt == task.attempt,
            Allocation.host.is_not(None),
        )
        .distinct()
    ).all()
    pending = session.scalar(
        select(SubTask.id)
        .where(
            SubTask.task_id == task.id,
            SubTask.attempt == task.attempt,
            SubTask.status == SubTaskStatus.PENDING,
        )
        .limit(1)
    )
    return sorted(h for h in hosts if h), pending is None


def finish(session: Session, *, sub: SubTask, data: Finished) -> Task:
    """Record a group's outcome and decide the task's fate.

    Only the current attempt's reports count. The task succeeds when every
    group has succeeded; fails at a `user` error (the training code raised);
    restarts (or fails when no restart is left) at an `infra` failure, or once
    every group has ended on `peer` errors alone. The same report again (the
    agent's client resends when an answer is lost) changes nothing and answers
    the same: a sub-task that has ended or was aborted keeps its status.
    """
    task = session.get_one(Task, sub.task_id, with_for_update=True)
    if sub.status is SubTaskStatus.RUNNING:
        lifecycle.move_sub_task(
            sub,
            SubTaskStatus.SUCCEEDED if data.succeeded else SubTaskStatus.FAILED,
            detail=data.detail,
        )
    if task.status.active and sub.attempt == task.attempt:
        decide(session, task, sub, data)
    session.commit()
    return task


def decide(session: Session, task: Task, sub: SubTask, data: Finished) -> None:
    """The task's fate after group `sub.group_index` of its current attempt reported `data`
    (the rules in :func:`finish`); the caller commits."""
    summary = (data.detail.splitlines() or ["no detail"])[0][:1000]
    reason = f"group {sub.group_index} failed: {summary}"
    if data.succeeded:
        if _all(session, task, {SubTaskStatus.SUCCEEDED}):
            lifecycle.transition(session, task, TaskStatus.SUCCEEDED, "all groups finished")
    elif data.cause == "user":
        lifecycle.transition(session, task, TaskStatus.FAILED, reason)
    elif data.cause == "infra":
        lifecycle.restart_or_fail(session, task, reason)
    elif _all(session, task, {SubTaskStatus.SUCCEEDED, SubTaskStatus.FAILED}):
        lifecycle.restart_or_fail(session, task, f"every group lost its peers; last: {reason}")


def _all(session: Session, task: Task, statuses: set[SubTaskStatus]) -> bool:
    """True if every sub-task of the task's current attempt has one of `statuses`."""
    return all(s in statuses for s in lifecycle.attempt_sub_statuses(session, task))


def running_on(agent_id: int) -> tuple[ColumnElement[bool], ...]:
    """Where-clauses (SubTask joined to Task): the sub-task runs on agent `agent_id` in its
    task's current attempt, and the task is active."""
    return (
        SubTask.agent_id == agent_id,
        SubTask.status == SubTaskStatus.RUNNING,
        SubTask.attempt == Task.attempt,
        Task.status.in_(ACTIVE),
    )


def restart_tasks_of(session: Session, *, agent: Agent, reason: str) -> int:
    """Restart (or fail) the tasks whose current sub-task runs on `agent`; the caller commits."""
    tasks = (
        session.scalars(
            select(Task)
            .join(SubTask, SubTask.task_id == Task.id)
            .where(*running_on(agent.id))
            .with_for_update(of=Task)
        )
        .unique()
        .all()
    )
    for task in tasks:
        lifecycle.restart_or_fail(session, task, reason)
    return len(tasks)
