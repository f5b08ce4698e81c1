"""The task lifecycle: every status change goes through `transition`."""

from sqlalchemy import update
from sqlalchemy.orm import Session

from backend.core.db import utcnow
from backend.core.errors import Conflict
from backend.tasks.models import Allocation, Task, TaskEvent, TaskStatus

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


def release_allocations(session: Session, *, task_id: int) -> None:
    """Release every node the task holds (idempotent)."""
    session.execute(
        update(Allocation)
        .where(Allocation.task_id == task_id, Allocation.released_at.is_(None))
        .values(released_at=utcnow())
    )


def transition(session: Session, task: Task, to: TaskStatus, reason: str) -> TaskEvent:
    """Move `task` to `to`, recording an event with `reason`; the caller commits.

    A terminal state releases all of the task's allocations in the same
    transaction, so no terminal task holds capacity.

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
    if to.terminal:
        task.finished_at = now
        release_allocations(session, task_id=task.id)
    event = TaskEvent(task_id=task.id, from_status=current, to_status=to, reason=reason,
                      created_at=now)
    session.add(event)
    return event


def record_creation(session: Session, task: Task) -> None:
    """The first event of a task: its submission."""
    session.add(TaskEvent(task_id=task.id, from_status=None, to_status=S.QUEUED,
                          reason="submitted"))
