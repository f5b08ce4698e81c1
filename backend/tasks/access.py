"""Who may see a task and submit one (the policy: docs/architecture.md, Access): a task is
visible to whoever may see its project (`backend/projects/access.py`). Used by REST and the
portal."""

from sqlalchemy.orm import Session

from backend.auth.models import User
from backend.core.errors import NotFound
from backend.projects import access as project_access
from backend.tasks.models import Task
from backend.tasks.schemas import TaskCreate


def readable_task(session: Session, *, user: User, task_id: int) -> Task:
    """The task, if `user` may see its project. Raises NotFound otherwise."""
    return project_access.readable_in_project(
        session, user=user, model=Task, row_id=task_id, noun="task", field="task_id"
    )


def check_submission(session: Session, *, user: User, data: TaskCreate) -> None:
    """The caller may add tasks to the project and see its code version and dependencies.

    Raises:
        NotFound: the project, code version or a dependency is not visible to `user`.
        Conflict: the project is archived.
    """
    project_access.writable_project(session, user=user, project_id=data.project_id)
    project_access.readable_version(session, user=user, version_id=data.code_version_id)
    check_dependencies(session, user=user, depends_on=getattr(data, "depends_on", None) or [])


def check_dependencies(session: Session, *, user: User, depends_on: list[int]) -> None:
    """Every task of `depends_on` is one `user` may see; another user's unshared task gets
    the very answer a task that does not exist gets, so its state stays unknown.

    Raises:
        NotFound: `depends_on.<index>` is not visible to `user`.
    """
    for index, task_id in enumerate(depends_on):
        try:
            readable_task(session, user=user, task_id=task_id)
        except NotFound as exc:
            raise NotFound(exc.message, field=f"depends_on.{index}") from exc
