"""Monitoring with alarm, repair or migration (source design: task flow manager monitoring).

Each scheduler pass marks agents whose heartbeats stopped offline, restarts
the tasks that ran on them (an alarm event, then RESTARTING and a new attempt
on healthy capacity, resumed from the last checkpoint), and publishes every
sub-task message not yet published or apparently lost (a broker restart).
"""

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from backend.agents.models import Agent, AgentState
from backend.core.db import utcnow
from backend.scheduler.dispatch import Dispatcher
from backend.tasks import lifecycle
from backend.tasks.models import Checkpoint, SubTask, SubTaskStatus, Task, TaskStatus
from contracts.payload import SubTaskPayload

log = logging.getLogger(__name__)
ACTIVE = [TaskStatus.SCHEDULED, TaskStatus.RUNNING]


def mark_stale_agents(session: Session, *, timeout_s: float, interval_s: float = 0.0,
                      watching_since: datetime | None = None) -> int:
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
        update(Agent).where(Agent.online.is_(True), Agent.last_heartbeat_at < cutoff)
        .values(online=False)
    )
    session.commit()
    return result.rowcount or 0  # type: ignore[attr-defined]


def _cutoff(timeout_s: float, interval_s: float) -> datetime:
    """Heartbeats older than this (naive UTC) are overdue for a pass every `interval_s`."""
    return utcnow() - timedelta(seconds=max(1.0, timeout_s - interval_s))


def _lost_sub_tasks(session: Session, *, pending_before: object) -> list[tuple[Task, str]]:
    """Current-attempt sub-tasks whose agent is offline, or unclaimed with no agent online."""
    running = session.execute(
        select(Task, Agent).join(SubTask, SubTask.task_id == Task.id)
        .join(Agent, Agent.id == SubTask.agent_id)
        .where(Task.status.in_(ACTIVE), SubTask.attempt == Task.attempt,
               SubTask.status == SubTaskStatus.RUNNING, Agent.online.is_(False))
    ).all()
    lost = [(task, f"agent '{agent.name}' on {agent.host} stopped sending heartbeats")
            for task, agent in running]
    online = select(Agent.id).where(Agent.resource_group_id == SubTask.resource_group_id,
                                    Agent.online.is_(True),
                                    Agent.state == AgentState.ACTIVE).exists()
    unclaimed = session.scalars(
        select(Task).join(SubTask, SubTask.task_id == Task.id)
        .where(Task.status.in_(ACTIVE), SubTask.attempt == Task.attempt,
               SubTask.status == SubTaskStatus.PENDING, SubTask.dispatched_at < pending_before,
               ~online)
    ).all()
    return lost + [(task, "no active agent of its group is online to start it")
                   for task in unclaimed]


def restart_tasks_of(session: Session, *, agent: Agent, reason: str) -> int:
    """Restart (or fail) the tasks whose current sub-task runs on `agent`; the caller commits."""
    tasks = session.scalars(
        select(Task).join(SubTask, SubTask.task_id == Task.id)
        .where(SubTask.agent_id == agent.id, SubTask.attempt == Task.attempt,
               SubTask.status == SubTaskStatus.RUNNING, Task.status.in_(ACTIVE))
        .with_for_update(of=Task)
    ).unique().all()
    for task in tasks:
        lifecycle.restart_or_fail(session, task, reason)
    return len(tasks)


def check(session: Session, *, timeout_s: float, interval_s: float = 1.0,
          watching_since: datetime | None = None) -> int:
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
    mark_stale_agents(session, timeout_s=timeout_s, interval_s=interval_s,
                      watching_since=watching_since)
    pending_before = utcnow() - timedelta(seconds=timeout_s)
    handled: set[int] = set()
    for task, reason in _lost_sub_tasks(session, pending_before=pending_before):
        if task.id in handled:
            continue
        handled.add(task.id)
        locked = session.get(Task, task.id, with_for_update=True, populate_existing=True)
        if locked is not None and locked.status in ACTIVE and locked.attempt == task.attempt:
            log.warning("task %s: %s", task.id, reason)
            lifecycle.restart_or_fail(session, locked, reason)
        session.commit()
    return len(handled)


def last_checkpoint(session: Session, *, task_id: int) -> Checkpoint | None:
    """The task's newest checkpoint (most steps), from any attempt."""
    return session.scalar(
        select(Checkpoint).where(Checkpoint.task_id == task_id)
        .order_by(Checkpoint.step.desc(), Checkpoint.id.desc()).limit(1))


PayloadFor = Callable[..., SubTaskPayload]


def make_durable(session: Session) -> None:
    """Wait until every transaction committed so far is on disk, then end the transaction.

    Scheduling decisions commit on PostgreSQL without waiting for the WAL flush
    (`service.schedule_next`); a transaction with a transaction id commits with
    the flush, which covers all earlier WAL. Called before a message leaves
    for the broker, so no agent ever acts on a decision a crash could undo;
    one flush per pass instead of one per decision. SQLite commits are durable.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_current_xact_id()))
        session.commit()


def dispatch_pending(session: Session, dispatcher: Dispatcher, payload_for: PayloadFor, *,
                     redispatch_after_s: float) -> int:
    """Publish each current-attempt sub-task never published, or unclaimed for too long.

    A message lost with a broker restart is sent again; a duplicate is
    harmless (the agent's claim refuses a taken sub-task). Returns messages sent.
    """
    stale = utcnow() - timedelta(seconds=redispatch_after_s)
    rows = session.execute(
        select(Task, SubTask).join(SubTask, SubTask.task_id == Task.id)
        .where(Task.status.in_(ACTIVE), SubTask.attempt == Task.attempt,
               SubTask.status == SubTaskStatus.PENDING,
               (SubTask.dispatched_at.is_(None)) | (SubTask.dispatched_at < stale))
        .order_by(SubTask.id)
    ).all()
    if rows:
        make_durable(session)
    sent = 0
    for task, sub in rows:
        resume = last_checkpoint(session, task_id=task.id) if task.attempt > 1 else None
        try:
            dispatcher.send(payload_for(task, sub, resume_checkpoint_id=resume and resume.id))
        except Exception:  # broker down: stays undispatched, sent again next pass
            log.warning("publishing sub-task %s failed; retrying next pass", sub.id, exc_info=True)
            session.rollback()
            return sent
        sub.dispatched_at = utcnow()
        session.commit()
        sent += 1
    return sent
