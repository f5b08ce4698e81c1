"""The task lifecycle: every status change goes through `transition`.

Failures found by the monitor go through `restart_or_fail`: an alarm event,
then a restart (RESTARTING, then QUEUED for the next attempt) while restarts
are left, else FAILED. Terminal states settle the tasks that depend on this one.
"""

from collections.abc import Callable

from sqlalchemy import event, select, update
from sqlalchemy.orm import Session

from backend.core.db import utcnow
from backend.core.errors import Conflict
from backend.scheduler.models import TaskDependency
from backend.tasks.models import (
    Allocation,
    EventKind,
    SubTask,
    SubTaskStatus,
    Task,
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
ACTIVE = frozenset({S.SCHEDULED, S.RUNNING})
_wakers: list[Callable[[], None]] = []


def add_waker(wake: Callable[[], None]) -> None:
    """Call `wake` after each commit that queues a task or frees nodes (the scheduler's loop)."""
    _wakers.append(wake)


def remove_waker(wake: Callable[[], None]) -> None:
    if wake in _wakers:
        _wakers.remove(wake)


def _wake_after_commit(session: Session) -> None:
    if _wakers and not event.contains(session, "after_commit", _wake_all):
        event.listen(session, "after_commit", _wake_all, once=True)


def _wake_all(_session: Session) -> None:
    for wake in list(_wakers):
        wake()


def release_allocations(session: Session, *, task_id: int) -> None:
    """Release every node the task holds (idempotent)."""
    session.execute(
        update(Allocation)
        .where(Allocation.task_id == task_id, Allocation.released_at.is_(None))
        .values(released_at=utcnow())
    )


def transition(session: Session, task: Task, to: TaskStatus, reason: str) -> TaskEvent:
    """Move `task` to `to`, recording an event with `reason`; the caller commits.

    A terminal state or RESTARTING releases all of the task's allocations in
    the same transaction, so no ended or restarting task holds capacity. A
    terminal state also settles the queued tasks that depend on this one.

    Raises:
        Conflict: `to` is not reachable from the task's current status.
    """
    current = task.status
    if to not in ALLOWED[current]:
        raise Conflict(f"task {task.id} is {current.value}; it cannot become {to.value}",
                       field="status")
    task.status = to
    task.status_reason = reason
    now = utcnow()
    if to is S.RUNNING and task.started_at is None:
        task.started_at = now
    if to.terminal or to is S.RESTARTING:
        release_allocations(session, task_id=task.id)
    if to.terminal:
        task.finished_at = now
    event = TaskEvent(task_id=task.id, from_status=current, to_status=to, reason=reason,
                      created_at=now)
    session.add(event)
    if to.terminal:
        session.flush()
        _settle_dependents(session, task)
    if to.terminal or to is S.QUEUED:
        _wake_after_commit(session)
    return event


def alarm(session: Session, task: Task, reason: str) -> TaskEvent:
    """Record an alarm: a failure the monitor detected (the status does not change)."""
    event = TaskEvent(task_id=task.id, from_status=task.status, to_status=task.status,
                      reason=reason, kind=EventKind.ALARM, created_at=utcnow())
    session.add(event)
    return event


def restart_or_fail(session: Session, task: Task, reason: str) -> bool:
    """Handle a failure of a running task's infrastructure (agent, process, parameter server).

    Records an alarm; while restarts are left, aborts the attempt's sub-tasks,
    goes RESTARTING (releasing its nodes) and back to QUEUED as the next
    attempt, which resumes from the last checkpoint. Otherwise FAILED. The
    caller commits. Returns True if the task will run again.
    """
    if task.status not in ACTIVE:
        return False
    alarm(session, task, f"alarm: {reason}")
    if task.attempt - 1 >= task.max_restarts:
        transition(session, task, S.FAILED,
                   f"{reason}; no restart left (max_restarts={task.max_restarts})")
        return False
    transition(session, task, S.RESTARTING, f"{reason}; restarting")
    session.execute(
        update(SubTask).where(SubTask.task_id == task.id, SubTask.attempt == task.attempt,
                              SubTask.status.in_([SubTaskStatus.PENDING, SubTaskStatus.RUNNING]))
        .values(status=SubTaskStatus.ABORTED, detail=f"aborted: {reason}")
    )
    task.attempt += 1
    task.master_addr, task.master_port = None, None
    transition(session, task, S.QUEUED,
               f"attempt {task.attempt} of {task.max_restarts + 1} queued after: {reason}")
    return True


def _settle_dependents(session: Session, task: Task) -> None:
    """Release the dependents of a succeeded task, or fail those of a failed one."""
    dependents = session.scalars(
        select(Task).join(TaskDependency, TaskDependency.task_id == Task.id)
        .where(TaskDependency.depends_on_id == task.id, Task.status == S.QUEUED)
        .order_by(Task.id)
    ).all()
    for dependent in dependents:
        if task.status is not S.SUCCEEDED:
            transition(session, dependent, S.FAILED,
                       f"dependency task {task.id} is {task.status.value}: "
                       f"{task.status_reason}"[:2000])
        elif not unfinished_dependencies(session, task_id=dependent.id):
            dependent.waiting = False


def unfinished_dependencies(session: Session, *, task_id: int) -> list[int]:
    """Ids of the tasks `task_id` depends on that have not succeeded yet."""
    return list(session.scalars(
        select(Task.id).join(TaskDependency, TaskDependency.depends_on_id == Task.id)
        .where(TaskDependency.task_id == task_id, Task.status != S.SUCCEEDED)
    ).all())


def record_creation(session: Session, task: Task) -> None:
    """The first event of a task: its submission."""
    session.add(TaskEvent(task_id=task.id, from_status=None, to_status=S.QUEUED,
                          reason="submitted"))
    _wake_after_commit(session)
