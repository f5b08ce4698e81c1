"""The task lifecycle: every status change, of a task or of a sub-task, is made here.

A task's status changes through :func:`change` (is it allowed, what it writes:
the task's columns and its event row, and what follows from it), applied to a
loaded task by :func:`transition`, or by the scheduler's booking as one SQL
statement (``backend.scheduler.booking``) for QUEUED -> SCHEDULED. A sub-task's
status changes through :func:`move_sub_task` (or :func:`abort_sub_tasks` for a
whole attempt). Failures go through :func:`restart_or_fail`: an alarm event,
then a restart (RESTARTING, then QUEUED for the next attempt) while restarts
are left, else FAILED. A restart the platform plans (a shrunk task taken in again
at an epoch end: ``backend.scheduler.regrow``) goes through :func:`restart_planned`:
no alarm, and it does not count against `max_restarts`. Terminal states settle the
tasks that depend on this one. A commit that queues a task or frees nodes wakes the scheduler
(:func:`add_waker`): the one way to wake it.
"""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import event, func, select, update
from sqlalchemy.orm import Session

from backend.core.db import utcnow
from backend.core.errors import Conflict
from backend.tasks.models import (
    ACTIVE,
    Allocation,
    EventKind,
    SubTask,
    SubTaskStatus,
    Task,
    TaskDependency,
    TaskEvent,
    TaskStatus,
)

S = TaskStatus
ALLOWED: dict[TaskStatus, frozenset[TaskStatus]] = {
    S.QUEUED: frozenset({S.SCHEDULED, S.FAILED, S.CANCELLED}),
    S.SCHEDULED: frozenset({S.RUNNING, S.FAILED, S.CANCELLED, S.RESTARTING, S.SUCCEEDED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED, S.RESTARTING}),
    S.RESTARTING: frozenset({S.QUEUED, S.FAILED, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}
Sub = SubTaskStatus
SUB_ALLOWED: dict[SubTaskStatus, frozenset[SubTaskStatus]] = {
    Sub.PENDING: frozenset({Sub.RUNNING, Sub.ABORTED}),
    Sub.RUNNING: frozenset({Sub.SUCCEEDED, Sub.FAILED, Sub.ABORTED}),
    Sub.SUCCEEDED: frozenset(),
    Sub.FAILED: frozenset(),
    Sub.ABORTED: frozenset(),
}
# Sub-task statuses an attempt's abort ends (those that may still become ABORTED).
ABORTABLE = [status for status, allowed in SUB_ALLOWED.items() if Sub.ABORTED in allowed]
_wakers: list[Callable[[], None]] = []
_WAKE = "polytrain.wake_scheduler"  # session.info key: wake after the next commit


def add_waker(wake: Callable[[], None]) -> None:
    """Call `wake` after each commit that queues a task or frees nodes (the scheduler's loop)."""
    _wakers.append(wake)


def remove_waker(wake: Callable[[], None]) -> None:
    if wake in _wakers:
        _wakers.remove(wake)


def _wake_after_commit(session: Session) -> None:
    """Wake the scheduler after the session's next commit (every such commit, not only the
    session's first: a long-lived session, as the scheduler's own, commits many)."""
    if not _wakers:
        return
    session.info[_WAKE] = True
    if not event.contains(session, "after_commit", _wake_all):
        event.listen(session, "after_commit", _wake_all)


def _wake_all(session: Session) -> None:
    if session.info.pop(_WAKE, False):
        for wake in list(_wakers):
            wake()


def release_allocations(session: Session, *, task_id: int) -> None:
    """Release every node the task holds (idempotent)."""
    session.execute(
        update(Allocation)
        .where(Allocation.task_id == task_id, Allocation.released_at.is_(None))
        .values(released_at=utcnow())
    )


@dataclass(frozen=True)
class Change:
    """One allowed status change of a task, as values: what :func:`transition` writes (and
    what the scheduler's booking writes in SQL for QUEUED -> SCHEDULED)."""

    task_id: int
    from_status: TaskStatus
    to_status: TaskStatus
    reason: str
    at: datetime  # naive UTC

    @property
    def releases(self) -> bool:
        """The task's nodes are released in the same transaction (ended or restarting)."""
        return self.to_status.terminal or self.to_status is S.RESTARTING

    @property
    def settles_dependents(self) -> bool:
        return self.to_status.terminal

    @property
    def wakes_scheduler(self) -> bool:
        """The commit frees nodes or queues a task."""
        return self.to_status.terminal or self.to_status is S.QUEUED

    @property
    def has_side_effects(self) -> bool:
        return self.releases or self.settles_dependents or self.wakes_scheduler

    def task_values(self) -> dict[str, Any]:
        """The task's columns this change sets (``started_at`` only on a first start: see
        :func:`transition`); a task that succeeded has all its progress (a plan's trial
        reports none: it times steps, it runs no epoch)."""
        values: dict[str, Any] = {"status": self.to_status, "status_reason": self.reason}
        if self.to_status.terminal:
            values["finished_at"] = self.at
        if self.to_status is S.SUCCEEDED:
            values["progress"] = 1.0
        return values

    def event_row(self) -> dict[str, Any]:
        """The task_event row recording this change."""
        return {
            "task_id": self.task_id,
            "from_status": self.from_status,
            "to_status": self.to_status,
            "reason": self.reason,
            "created_at": self.at,
            "kind": EventKind.STATUS,
        }


def change(task_id: int, current: TaskStatus, to: TaskStatus, reason: str) -> Change:
    """The change of task `task_id` from `current` to `to`, now.

    Raises:
        Conflict: `to` is not reachable from `current` (field `status`).
    """
    if to not in ALLOWED[current]:
        raise Conflict(
            f"task {task_id} is {current.value}; it cannot become {to.value}", field="status"
        )
    return Change(task_id, current, to, reason, utcnow())


def transition(session: Session, task: Task, to: TaskStatus, reason: str) -> TaskEvent:
    """Move `task` to `to`, recording an event with `reason`; the caller commits.

    A terminal state or RESTARTING releases all of the task's allocations in
    the same transaction, so no ended or restarting task holds capacity. A
    terminal state also settles the queued tasks that depend on this one.

    Raises:
        Conflict: `to` is not reachable from the task's current status.
    """
    done = change(task.id, task.status, to, reason)
    for column, value in done.task_values().items():
        setattr(task, column, value)
    if to is S.RUNNING and task.started_at is None:
        task.started_at = done.at
    if done.releases:
        release_allocations(session, task_id=task.id)
    event = TaskEvent(**done.event_row())
    session.add(event)
    if done.settles_dependents:
        session.flush()
        _settle_dependents(session, task)
    if done.wakes_scheduler:
        _wake_after_commit(session)
    return event


def move_sub_task(sub: SubTask, to: SubTaskStatus, *, detail: str | None = None) -> None:
    """Change one sub-task's status (and its detail, kept to its last 4000 characters).

    Raises:
        Conflict: `to` is not reachable from the sub-task's status (field `status`).
    """
    if to not in SUB_ALLOWED[sub.status]:
        raise Conflict(
            f"sub-task {sub.id} is {sub.status.value}; it cannot become {to.value}", field="status"
        )
    sub.status = to
    if detail is not None:
        sub.detail = detail[-4000:]


def abort_sub_tasks(session: Session, task: Task, reason: str) -> None:
    """Abort every sub-task of `task`'s current attempt that has not ended (one statement)."""
    session.execute(
        update(SubTask)
        .where(
            SubTask.task_id == task.id,
            SubTask.attempt == task.attempt,
            SubTask.status.in_(ABORTABLE),
        )
        .values(status=Sub.ABORTED, detail=f"aborted: {reason}")
    )


def attempt_sub_statuses(session: Session, task: Task) -> list[SubTaskStatus]:
    """The statuses of the sub-tasks of `task`'s current attempt."""
    return list(
        session.scalars(
            select(SubTask.status).where(
                SubTask.task_id == task.id, SubTask.attempt == task.attempt
            )
        ).all()
    )


def alarm(
    session: Session, task: Task, reason: str, kind: EventKind = EventKind.ALARM
) -> TaskEvent:
    """Record an alarm: a failure the monitor detected (the status does not change); with
    ``kind`` GUARD, a guard move instead."""
    event = TaskEvent(
        task_id=task.id,
        from_status=task.status,
        to_status=task.status,
        reason=reason,
        kind=kind,
        created_at=utcnow(),
    )
    session.add(event)
    return event


def restart_or_fail(session: Session, task: Task, reason: str) -> bool:
    """Handle a failure of a running task's infrastructure (agent, process, parameter server).

    Records an alarm; while restarts are left, aborts the attempt's sub-tasks,
    goes RESTARTING (releasing its nodes) and back to QUEUED as the next
    attempt, which resumes from the last checkpoint. Otherwise FAILED. Planned
    restarts (:func:`restart_planned`) are not counted against `max_restarts`. The
    caller commits. Returns True if the task will run again.
    """
    if task.status not in ACTIVE:
        return False
    alarm(session, task, f"alarm: {reason}")
    planned = planned_restarts(session, task)
    if task.attempt - 1 - planned >= task.max_restarts:
        transition(
            session, task, S.FAILED, f"{reason}; no restart left (max_restarts={task.max_restarts})"
        )
        return False
    transition(session, task, S.RESTARTING, f"{reason}; restarting")
    _next_attempt(
        session,
        task,
        reason,
        # The last attempt there may be: the first, the restarts allowed, the planned ones.
        f"attempt {task.attempt + 1} of {task.max_restarts + 1 + planned} queued after: {reason}",
    )
    return True


PLANNED = "; a planned restart, not a failure (max_restarts unchanged)"
"""The end of the RESTARTING event's reason of a planned restart, and only of one (a
failure's ends in "; restarting"): the task's timeline is the record of which of its
attempts were planned (:func:`planned_restarts`, :func:`attempt_planned`)."""


def restart_planned(session: Session, task: Task, reason: str) -> None:
    """Restart an active task as the platform planned, not after a failure: no alarm, the
    attempt's sub-tasks aborted, RESTARTING (releasing its nodes), then QUEUED as the next
    attempt. It does not count against `max_restarts`. The caller books the new attempt
    (``backend.scheduler.regrow``, in the same transaction) and commits.

    Raises:
        Conflict: the task is not SCHEDULED or RUNNING.
    """
    transition(session, task, S.RESTARTING, f"{reason}{PLANNED}")
    _next_attempt(session, task, reason, f"attempt {task.attempt + 1} queued: {reason}")


def _next_attempt(session: Session, task: Task, reason: str, queued: str) -> None:
    """From RESTARTING: abort the attempt's sub-tasks and queue the next attempt (`queued`
    the QUEUED event's reason)."""
    abort_sub_tasks(session, task, reason)
    task.attempt += 1
    task.master_addr, task.master_port = None, None
    task.pace_start_at = task.pace_start_progress = task.progress_at = None  # a new pace
    task.pace_epoch_at = task.pace_epoch_progress = None
    transition(session, task, S.QUEUED, queued)


def planned_restarts(session: Session, task: Task) -> int:
    """How many of `task`'s restarts were planned (:func:`restart_planned`); the others
    count against `max_restarts`."""
    if task.attempt == 1:
        return 0
    return (
        session.scalar(
            select(func.count(TaskEvent.id)).where(
                TaskEvent.task_id == task.id,
                TaskEvent.kind == EventKind.STATUS,
                TaskEvent.to_status == S.RESTARTING,
                TaskEvent.reason.endswith(PLANNED, autoescape=True),
            )
        )
        or 0
    )


def attempt_planned(session: Session, task: Task) -> bool:
    """True when `task`'s current attempt was started by a planned restart (its last
    RESTARTING event is one)."""
    if task.attempt == 1:
        return False
    last = session.scalar(
        select(TaskEvent.reason)
        .where(
            TaskEvent.task_id == task.id,
            TaskEvent.kind == EventKind.STATUS,
            TaskEvent.to_status == S.RESTARTING,
        )
        .order_by(TaskEvent.id.desc())
        .limit(1)
    )
    return last is not None and last.endswith(PLANNED)


def _settle_dependents(session: Session, task: Task) -> None:
    """Release the dependents of a succeeded task, or fail those of a failed one."""
    dependents = session.scalars(
        select(Task)
        .join(TaskDependency, TaskDependency.task_id == Task.id)
        .where(TaskDependency.depends_on_id == task.id, Task.status == S.QUEUED)
        .order_by(Task.id)
    ).all()
    for dependent in dependents:
        if task.status is not S.SUCCEEDED:
            transition(
                session,
                dependent,
                S.FAILED,
                f"dependency task {task.id} is {task.status.value}: {task.status_reason}"[:2000],
            )
        elif not unfinished_dependencies(session, task_id=dependent.id):
            dependent.waiting = False


def unfinished_dependencies(session: Session, *, task_id: int) -> list[int]:
    """Ids of the tasks `task_id` depends on that have not succeeded yet."""
    return list(
        session.scalars(
            select(Task.id)
            .join(TaskDependency, TaskDependency.depends_on_id == Task.id)
            .where(TaskDependency.task_id == task_id, Task.status != S.SUCCEEDED)
        ).all()
    )


def record_creation(session: Session, task: Task) -> None:
    """The first event of a task: its submission."""
    session.add(
        TaskEvent(task_id=task.id, from_status=None, to_status=S.QUEUED, reason="submitted")
    )
    _wake_after_commit(session)
