"""What agents report through the internal API: claims, rendezvous, logs, metrics, results."""

import os
import tempfile
from pathlib import Path

from sqlalchemy import select, tuple_, update
from sqlalchemy.orm import Session

from backend.agents.models import Agent, AgentState
from backend.core.db import utcnow
from backend.core.errors import Conflict, Invalid, NotFound
from backend.tasks import lifecycle
from backend.tasks.models import (
    Allocation,
    Checkpoint,
    LogLine,
    Metric,
    NodeRole,
    SubTask,
    SubTaskStatus,
    Task,
    TaskStatus,
)
from contracts.agent_api import (
    CHECKPOINT_NAME,
    Claim,
    Finished,
    LogBatch,
    MetricBatch,
    Progress,
    RunningRanks,
)


def get_sub_task(session: Session, *, sub_task_id: int) -> SubTask:
    sub = session.get(SubTask, sub_task_id)
    if sub is None:
        raise NotFound(f"sub-task {sub_task_id} does not exist")
    return sub


def claim(session: Session, *, sub: SubTask, data: Claim) -> SubTask:
    """An agent takes a sub-task. A redelivered message finds it taken: Conflict.

    A message of an earlier attempt (the task restarted since) is refused too.
    The first claim moves the task from SCHEDULED to RUNNING. An agent an
    admin drained or disabled is refused too, and the sub-task is published
    again at the scheduler's next pass for an active agent to take.

    Raises:
        NotFound: `data.agent_id` names no registered agent.
        Conflict: the sub-task is taken, of another attempt, or the agent is not active.
    """
    agent = session.get(Agent, data.agent_id)
    if agent is None:
        raise NotFound(f"agent {data.agent_id} is not registered", field="agent_id")
    if agent.state is not AgentState.ACTIVE:
        if sub.status is SubTaskStatus.PENDING:
            sub.dispatched_at = None
            session.commit()
        raise Conflict(f"agent '{agent.name}' is {agent.state.value}: it takes no new sub-tasks",
                       field="agent_id")
    task = session.get_one(Task, sub.task_id, with_for_update=True)
    if (sub.status is not SubTaskStatus.PENDING or task.status not in lifecycle.ACTIVE
            or sub.attempt != task.attempt or data.attempt != sub.attempt):
        raise Conflict(f"sub-task {sub.id} (attempt {sub.attempt}) is {sub.status.value}; "
                       f"task is {task.status.value} in attempt {task.attempt}")
    sub.status, sub.agent_id = SubTaskStatus.RUNNING, data.agent_id
    roles = [NodeRole.COMPUTE] + ([NodeRole.PARAMETER_SERVER, NodeRole.TASK_MANAGER]
                                   if sub.hosts_parameter_server else [])
    session.execute(
        update(Allocation).where(Allocation.task_id == task.id, Allocation.attempt == sub.attempt,
                                 Allocation.resource_group_id == sub.resource_group_id,
                                 Allocation.role.in_(roles)).values(host=data.host)
    )
    if task.status is TaskStatus.SCHEDULED:
        lifecycle.transition(session, task, TaskStatus.RUNNING,
                             f"agent on {data.host} started group {sub.group_index}")
    session.commit()
    return sub


def peer_hosts(session: Session, task: Task) -> tuple[list[str], bool]:
    """The hosts the agents of `task`'s current attempt claimed its sub-tasks from (sorted),
    and whether every sub-task of the attempt is claimed."""
    hosts = session.scalars(
        select(Allocation.host).where(Allocation.task_id == task.id,
                                      Allocation.attempt == task.attempt,
                                      Allocation.host.is_not(None)).distinct()
    ).all()
    pending = session.scalar(
        select(SubTask.id).where(SubTask.task_id == task.id, SubTask.attempt == task.attempt,
                                 SubTask.status == SubTaskStatus.PENDING).limit(1)
    )
    return sorted(h for h in hosts if h), pending is None


def add_logs(session: Session, *, task_id: int, batch: LogBatch) -> int:
    """Store log lines; a line already stored (same node and seq) is skipped."""
    keys = {(line.attempt, line.node, line.seq) for line in batch.lines}
    if not keys:
        return 0
    existing = set(session.execute(
        select(LogLine.attempt, LogLine.node, LogLine.seq).where(
            LogLine.task_id == task_id,
            tuple_(LogLine.attempt, LogLine.node, LogLine.seq).in_(list(keys)))
    ).all())
    new = [LogLine(task_id=task_id, **line.model_dump()) for line in batch.lines
           if (line.attempt, line.node, line.seq) not in existing]
    session.add_all(new)
    session.commit()
    return len(new)


def add_metrics(session: Session, *, task_id: int, batch: MetricBatch) -> None:
    session.add_all(Metric(task_id=task_id, **m.model_dump()) for m in batch.metrics)
    session.commit()


def set_progress(session: Session, *, task: Task, data: Progress) -> None:
    task.progress, task.epoch = data.progress, data.epoch
    session.commit()


def save_checkpoint(
    session: Session, *, task: Task, directory: Path, name: str, epoch: int, step: int, body: bytes,
    attempt: int = 1,
) -> Checkpoint:
    """Store an uploaded checkpoint file as `directory/task-<id>/<name>` (`attempt-<n>/` after 1).

    A name is stored once and never overwritten: the same name with the same bytes
    again (an upload retried after a lost answer) returns the stored checkpoint.

    Raises:
        Invalid: `name` is empty, `.`/`..`, hidden, or not a plain file name (field `name`).
        Conflict: a checkpoint of this name and attempt with other content exists (`name`).
    """
    check_checkpoint_name(name)
    folder = directory / f"task-{task.id}"
    if attempt > 1:
        folder = folder / f"attempt-{attempt}"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = (folder / name).resolve()
    if not _write_new(path, body):
        if path.read_bytes() != body:
            raise Conflict(f"checkpoint '{name}' of attempt {attempt} already exists with "
                           "other content; it is kept", field="name")
        stored = session.scalar(select(Checkpoint).where(
            Checkpoint.task_id == task.id, Checkpoint.path == str(path)).limit(1))
        if stored is not None:
            return stored
    checkpoint = Checkpoint(task_id=task.id, epoch=epoch, step=step, path=str(path),
                            size_bytes=len(body), attempt=attempt)
    session.add(checkpoint)
    session.commit()
    return checkpoint


def check_checkpoint_name(name: str) -> None:
    """Refuse a checkpoint name that is not one plain, visible file name.

    Raises:
        Invalid: naming the field `name`.
    """
    if not CHECKPOINT_NAME.fullmatch(name):
        raise Invalid(f"checkpoint name {name!r} is not a file name: use letters, digits, '.', "
                      "'_' and '-', not starting with '.' (e.g. 'epoch-3.pt')", field="name")


def _write_new(path: Path, body: bytes) -> bool:
    """Write `body` to `path` only if no file is there (atomic: a half-written file is never
    seen under `path`); False if one is."""
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".upload-", delete=False) as tmp:
        tmp.write(body)
    try:
        os.link(tmp.name, path)  # fails if `path` exists, unlike a rename
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp.name)
    return True


def finish(session: Session, *, sub: SubTask, data: Finished) -> Task:
    """Record a group's outcome and decide the task's fate.

    Only the current attempt's reports count. The task succeeds when every
    group has succeeded; fails at a `user` error (the training code raised);
    restarts (or fails when no restart is left) at an `infra` failure, or once
    every group has ended on `peer` errors alone.
    """
    task = session.get_one(Task, sub.task_id, with_for_update=True)
    if sub.status is not SubTaskStatus.ABORTED:
        sub.status = SubTaskStatus.SUCCEEDED if data.succeeded else SubTaskStatus.FAILED
        sub.detail = data.detail[-4000:]
    if task.status in lifecycle.ACTIVE and sub.attempt == task.attempt:
        _decide(session, task, sub, data)
    session.commit()
    return task


def _decide(session: Session, task: Task, sub: SubTask, data: Finished) -> None:
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
    found = session.scalars(select(SubTask.status).where(
        SubTask.task_id == task.id, SubTask.attempt == task.attempt)).all()
    return all(s in statuses for s in found)


def node_heartbeats(session: Session, *, running: list[RunningRanks]) -> None:
    """Stamp the held allocations of ranks whose processes an agent saw alive."""
    now = utcnow()
    for entry in running:
        session.execute(
            update(Allocation).where(Allocation.task_id == entry.task_id,
                                     Allocation.rank.in_(entry.ranks),
                                     Allocation.released_at.is_(None))
            .values(last_heartbeat_at=now)
        )
