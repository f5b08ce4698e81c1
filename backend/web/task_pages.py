"""Portal pages of tasks: the list, one task (live logs and charts), cancel and retry."""

from typing import Annotated

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import Response

from backend.auth.dependencies import CsrfCheck, WebUser
from backend.core.dependencies import SessionDep
from backend.core.errors import ServiceError
from backend.projects import access as project_access
from backend.tasks import access as task_access
from backend.tasks import service as tasks
from backend.tasks.schemas import TaskUpdate
from backend.web import views
from backend.web.task_lists import ListQuery, parse_tags
from backend.web.templating import fragment, redirect, render

router = APIRouter(include_in_schema=False)


@router.get("/")
def task_list(
    request: Request, session: SessionDep, user: WebUser, query: Annotated[ListQuery, Query()]
) -> Response:
    """The tasks the user may see, newest first, filtered and paged; status and progress
    refresh in the page."""
    return render(request, "tasks.html", views.tasks_page(session, user, query))


@router.get("/compare")
def compare_tasks(
    request: Request,
    session: SessionDep,
    user: WebUser,
    ids: Annotated[list[int], Query(max_length=50)] = [],  # noqa: B006 (FastAPI copies it)
) -> Response:
    """Tasks side by side (selected in a task list): what differs, final metrics, curves."""
    return render(request, "compare.html", views.compare_page(session, user, ids))


@router.post("/tasks/{task_id}/tags", dependencies=[CsrfCheck])
def set_tags(
    request: Request,
    task_id: int,
    session: SessionDep,
    user: WebUser,
    tags: Annotated[str, Form()] = "",
) -> Response:
    """Replace the task's tags with those typed (separated by spaces or commas)."""
    task = task_access.readable_task(session, user=user, task_id=task_id)
    project_access.writable_project(session, user=user, project_id=task.project_id)
    names, error = parse_tags(tags)
    if error:
        return redirect(f"/tasks/{task_id}", flash=f"Tags not changed: {error}.", kind="error")
    tasks.update(session, task=task, data=TaskUpdate(tags=list(names)))
    return redirect(f"/tasks/{task_id}", flash=f"Tags of task {task_id} saved.")


@router.get("/tasks/{task_id}")
def task_detail(request: Request, task_id: int, session: SessionDep, user: WebUser) -> Response:
    """A task: status, timeline, nodes, metrics charts, live logs, checkpoints."""
    task = task_access.readable_task(session, user=user, task_id=task_id)
    return render(request, "task.html", views.task_page(session, user, task))


@router.get("/tasks/{task_id}/provenance-section")
def task_provenance_section(
    request: Request, task_id: int, session: SessionDep, user: WebUser
) -> Response:
    """The task page's "Where the data went" section alone (HTML), for the page to replace
    its own with as checkpoints arrive: not the whole page again."""
    task = task_access.readable_task(session, user=user, task_id=task_id)
    return fragment(request, "task_provenance.html", views.provenance_section(session, task))


@router.post("/tasks/{task_id}/cancel", dependencies=[CsrfCheck])
def cancel_task(request: Request, task_id: int, session: SessionDep, user: WebUser) -> Response:
    """Cancel the task and return to its page; a task that has ended says so in a flash."""
    task = task_access.readable_task(session, user=user, task_id=task_id)
    try:
        tasks.cancel(session, task=task)
    except ServiceError as exc:
        session.rollback()
        return redirect(f"/tasks/{task_id}", flash=exc.message, kind="error")
    return redirect(f"/tasks/{task_id}", flash=f"Task {task_id} cancelled.")


@router.post("/tasks/{task_id}/retry", dependencies=[CsrfCheck])
def retry_task(request: Request, task_id: int, session: SessionDep, user: WebUser) -> Response:
    """Submit a copy of the ended task and open the new one."""
    task = task_access.readable_task(session, user=user, task_id=task_id)
    try:
        project_access.writable_project(session, user=user, project_id=task.project_id)
        copy = tasks.retry(session, task=task)
    except ServiceError as exc:
        session.rollback()
        return redirect(f"/tasks/{task_id}", flash=exc.message, kind="error")
    return redirect(f"/tasks/{copy.id}", flash=f"Task {copy.id} submitted: a retry of {task_id}.")
