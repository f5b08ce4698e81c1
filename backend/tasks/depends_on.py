"""Checks of a task's `depends_on` at submission and update: tasks that exist, of the same
owner, no cycle; and recording the edges (`TaskDependency`) the lifecycle settles."""

from collections.abc import Iterable

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from backend.core.errors import Invalid
from backend.projects.models import Project
from backend.tasks.models import Task, TaskDependency, TaskStatus
from backend.tasks.spec import read_spec, write_spec

BAD_END = (TaskStatus.FAILED, TaskStatus.CANCELLED)


def _owner_of(session: Session, project_id: int) -> int | None:
    project = session.get(Project, project_id)
    return getattr(project, "owner_id", None) if project else None


def check(
    session: Session, *, project_id: int, depends_on: Iterable[int], task_id: int | None = None
) -> list[Task]:
    """The dependency tasks, locked against a concurrent status change until commit.

    Raises:
        Invalid: a task does not exist, belongs to another user's project, has
            already failed or been cancelled, or (for `task_id`) closes a cycle.
    """
    ids = sorted(set(depends_on))
    found = {
        t.id: t
        for t in session.scalars(
            select(Task).where(Task.id.in_(ids)).with_for_update().order_by(Task.id)
        )
    }
    owner = _owner_of(session, project_id)
    for index, dep_id in enumerate(ids):
        field = f"depends_on.{index}"
        dep = found.get(dep_id)
        if dep is None:
            raise Invalid(f"dependency task {dep_id} does not exist", field=field)
        if owner is not None and _owner_of(session, dep.project_id) not in (None, owner):
            raise Invalid(f"dependency task {dep_id} belongs to another user", field=field)
        if dep.status in BAD_END:
            raise Invalid(
                f"dependency task {dep_id} is {dep.status.value}; this task could never start",
                field=field,
            )
    if task_id is not None:
        _check_cycle(session, task_id, ids)
    return [found[i] for i in ids]


def _check_cycle(session: Session, task_id: int, depends_on: list[int]) -> None:
    """Refuse edges task_id -> depends_on that would make a cycle (depth-first walk)."""
    for start in depends_on:
        path = _path(session, start, task_id)
        if path is not None:
            chain = " → ".join(str(t) for t in [task_id, *path])
            raise Invalid(f"dependency cycle: {chain}", field="depends_on")


def _path(session: Session, start: int, goal: int) -> list[int] | None:
    """A dependency chain from `start` to `goal`, or None."""
    parents: dict[int, int | None] = {start: None}
    frontier = [start]
    while frontier:
        node = frontier.pop()
        if node == goal:
            chain = [node]
            while parents[chain[-1]] is not None:
                chain.append(parents[chain[-1]])  # type: ignore[arg-type]
            return chain[::-1]
        for nxt in session.scalars(
            select(TaskDependency.depends_on_id).where(TaskDependency.task_id == node)
        ):
            if nxt not in parents:
                parents[nxt] = node
                frontier.append(nxt)
    return None


def record(session: Session, *, task: Task, deps: list[Task]) -> None:
    """Store `task`'s dependencies (replacing any) and whether it waits on them."""
    session.execute(delete(TaskDependency).where(TaskDependency.task_id == task.id))
    session.add_all(TaskDependency(task_id=task.id, depends_on_id=d.id) for d in deps)
    task.waiting = any(d.status is not TaskStatus.SUCCEEDED for d in deps)
    write_spec(task, read_spec(task).model_copy(update={"depends_on": [d.id for d in deps]}))
