"""Monitoring with alarm, repair or migration (source design: task flow manager monitoring).

Each scheduler pass marks agents whose heartbeats stopped offline and restarts
the tasks that ran on them (an alarm event, then RESTARTING and a new attempt
on healthy capacity, resumed from the last checkpoint: the lifecycle's
:func:`backend.tasks.lifecycle.restart_or_fail`). Publishing is
:mod:`backend.scheduler.dispatch`'s.
"""

import logging
from datetime import datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from backend.agents.models import SERVING, Agent
from backend.core.db import utcnow
from backend.tasks import lifecycle
from backend.tasks.models import ACTIVE, SubTask, SubTaskStatus, Task

log = logging.getLogger(__name__)


def mark_stale_agents(
    session: Session,
    *,
    timeout_s: float,
    interval_s: float = 0.0,
    watching_since: datetime | None = None,
) -> int:
    """Mark agents offline whose last heartbeat is older than `timeout_s - interval_s` seconds.

    The margin of one scheduler interval makes a pass running every
    `interval_s` seconds notice a silent agent within `timeout_s` of its death.

    `watching_since` (naive UTC) is when this scheduler started watching: an
    agent's staleness clock starts no earlier, so heartbeats the agents sent
    while the API was down (and lost) never count against them, and after a
    restart every agent gets one full `timeout_s` to reach the new process.
    Returns how many agents went offline.
    """
    cutoff = _cutoff(timeout_s, interval_s)
    if watching_since is not None and watching_since >= cutoff:
        return 0  # not watched for a full timeout yet: no heartbeat can be overdue
    result = session.execute(
        update(Agent)
        .where(Agent.online.is_(True), Agent.last_heartbeat_at < cutoff)
        .values(online=False)
    )
    session.commit()
    return result.rowcount or 0  # type: ignore[attr-defined]


def _cutoff(timeout_s: float, interval_s: float) -> datetime:
    """Heartbeats older than this (naive UTC) are overdue for a pass every `interval_s`."""
    return utcnow() - timedelta(seconds=max(1.0, timeout_s - interval_s))


def _lost_sub_tasks(session: Session, *, pending_before: object) -> list[tuple[Task, str]]:
    """Current-attempt sub-tasks whose agent is offline, or unclaimed with no agent online,
    or booked for no agent (none has the room) for a full timeout."""
    running = session.execute(
        select(Task, Agent)
        .join(SubTask, SubTask.task_id == Task.id)
        .join(Agent, Agent.id == SubTask.agent_id)
        .where(
            Task.status.in_(ACTIVE),
            SubTask.attempt == Task.attempt,
            SubTask.status == SubTaskStatus.RUNNING,
            Agent.online.is_(False),
        )
    ).all()
    lost = [
        (task, f"agent '{agent.name}' on {agent.host} stopped sending heartbeats")
        for task, agent in running
    ]
    online = (
        select(Agent.id)
        .where(Agent.resource_group_id == SubTask.resource_group_id, SERVING)
        .exists()
    )
    unclaimed = session.execute(
        select(Task, online)
        .join(SubTask, SubTask.task_id == Task.id)
        .where(
            Task.status.in_(ACTIVE),
            SubTask.attempt == Task.attempt,
            SubTask.status == SubTaskStatus.PENDING,
            # Published that long ago; or, booked for no agent (none had room), waiting since.
            func.coalesce(SubTask.dispatched_at, SubTask.updated_at) < pending_before,
            ~online | SubTask.agent_id.is_(None),
        )
    ).all()
    return lost + [
        (
            task,
            "no active agent of its group has the free workers to start a part"
            if any_online
            else "no active agent of its group is online to start it",
        )
        for task, any_online in unclaimed
    ]


def check(
    session: Session,
    *,
    timeout_s: float,
    interval_s: float = 1.0,
    watching_since: datetime | None = None,
) -> int:
    """Detect dead agents and restart (or fail) their tasks; returns tasks handled.

    `watching_since` (naive UTC, the scheduler's start): until this scheduler
    has watched for a full `timeout_s - interval_s`, it judges nothing. An
    agent's `online` flag may be stale then: the previous API process could not
    hear heartbeats while it shut down and may have cleared it, and the agents
    may simply not have reached the new process yet. After that, every live
    agent has heartbeated (and is online again), and an unclaimed sub-task
    counts as lost only once it has waited a full timeout.
    """
    if watching_since is not None and watching_since >= _cutoff(timeout_s, interval_s):
        return 0
    mark_stale_agents(
        session, timeout_s=timeout_s, interval_s=interval_s, watching_since=watching_since
    )
    pending_before = utcnow() - timedelta(seconds=timeout_s)
    handled: set[int] = set()
    for task, reason in _lost_sub_tasks(session, pending_before=pending_before):
        if task.id in handled:
            continue
        handled.add(task.id)
        locked = session.get(Task, task.id, with_for_update=True, populate_existing=True)
        if locked is not None and locked.status.active and locked.attempt == task.attempt:
            log.warning("task %s: %s", task.id, reason)
            lifecycle.restart_or_fail(session, locked, reason)
        session.commit()
    return len(handled)
