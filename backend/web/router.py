"""The web portal: server-rendered pages over the same services as the REST API.

Routes are sync `def` (FastAPI runs them in its threadpool) and only call
service functions, through `backend.web.views` for what a page shows and
`backend.web.forms` for what a form submits. A refused form is shown again
with status 422, the entered values kept and each message next to its field.
"""

import functools
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import HTMLResponse, Response

from backend.core.deps import SessionDep, SettingsDep
from backend.core.errors import NotFound, ServiceError
from backend.projects import service as projects
from backend.tasks import service as tasks
from backend.web import forms, views
from backend.web.forms import ProjectForm, TaskForm
from backend.web.templating import redirect, render

router = APIRouter(include_in_schema=False)


def html_errors(route: Callable[..., Response]) -> Callable[..., Response]:
    """Show a missing project or task as an HTML 404 page rather than the API's JSON."""

    @functools.wraps(route)
    def wrapper(*args: Any, **kwargs: Any) -> Response:
        try:
            return route(*args, **kwargs)
        except NotFound as exc:
            context = {"title": "Not found", "message": exc.message}
            return render(kwargs["request"], "error.html", context, status_code=404)

    return wrapper


def _wake_scheduler(request: Request) -> None:
    scheduler = getattr(request.app.state, "scheduler", None)
    if scheduler is not None:
        scheduler.wake()


@router.get("/", response_class=HTMLResponse)
def task_list(request: Request, session: SessionDep) -> Response:
    """All tasks, newest first; status and progress refresh in the page."""
    return render(request, "tasks.html", views.tasks_page(session))


@router.get("/projects", response_class=HTMLResponse)
def project_list(request: Request, session: SessionDep) -> Response:
    """All projects and the create-project form."""
    return render(request, "projects.html", views.projects_page(session))


@router.post("/projects", response_class=HTMLResponse)
def create_project(
    request: Request, session: SessionDep, form: Annotated[ProjectForm, Form()]
) -> Response:
    """Create a project and open it; a refused name shows the form again (422)."""
    project, errors = forms.create_project(session, form)
    if project is None:
        context = views.projects_page(session, form, errors)
        return render(request, "projects.html", context, status_code=422)
    return redirect(f"/projects/{project.id}", flash=f"Project '{project.name}' created.")


@router.get("/projects/{project_id}", response_class=HTMLResponse)
@html_errors
def project_detail(request: Request, project_id: int, session: SessionDep) -> Response:
    """A project's code versions and tasks, and the task submission form."""
    project = projects.get(session, project_id=project_id)
    return render(request, "project.html", views.project_page(session, project))


@router.post("/projects/{project_id}/code-versions", response_class=HTMLResponse)
@html_errors
def add_example_version(
    request: Request,
    project_id: int,
    session: SessionDep,
    example: Annotated[str, Form()] = "",
) -> Response:
    """Add a bundled example as the project's next code version."""
    project = projects.get(session, project_id=project_id)
    version, errors = forms.add_example_version(session, project, example)
    if version is None:
        context = views.project_page(session, project, errors=errors, example=example)
        return render(request, "project.html", context, status_code=422)
    return redirect(
        f"/projects/{project.id}",
        flash=f"Code version v{version.version} added ({version.filename}).",
    )


@router.post("/projects/{project_id}/code-versions/upload", response_class=HTMLResponse)
@html_errors
def upload_version(
    request: Request,
    project_id: int,
    session: SessionDep,
    settings: SettingsDep,
    file: Annotated[UploadFile | None, File()] = None,
) -> Response:
    """Upload a `.py` training module as the project's next code version."""
    project = projects.get(session, project_id=project_id)
    version, errors = forms.add_uploaded_version(session, settings, project, file)
    if version is None:
        context = views.project_page(session, project, errors=errors)
        return render(request, "project.html", context, status_code=422)
    return redirect(
        f"/projects/{project.id}",
        flash=f"Code version v{version.version} added ({version.filename}).",
    )


@router.post("/projects/{project_id}/tasks", response_class=HTMLResponse)
@html_errors
def submit_task(
    request: Request,
    project_id: int,
    session: SessionDep,
    form: Annotated[TaskForm, Form()],
) -> Response:
    """Queue a task from the submission form and open its page; refusals show inline (422)."""
    project = projects.get(session, project_id=project_id)
    task, errors = forms.submit_task(session, project, form)
    if task is None:
        context = views.project_page(session, project, form=form, errors=errors)
        return render(request, "project.html", context, status_code=422)
    _wake_scheduler(request)
    return redirect(f"/tasks/{task.id}", flash=f"Task {task.id} submitted.")


@router.get("/tasks/{task_id}", response_class=HTMLResponse)
@html_errors
def task_detail(request: Request, task_id: int, session: SessionDep) -> Response:
    """A task: status, timeline, nodes, metrics charts, live logs, checkpoints."""
    task = tasks.get(session, task_id=task_id)
    return render(request, "task.html", views.task_page(session, task))


@router.post("/tasks/{task_id}/cancel", response_class=HTMLResponse)
@html_errors
def cancel_task(request: Request, task_id: int, session: SessionDep) -> Response:
    """Cancel the task and return to its page; a task that has ended says so in a flash."""
    task = tasks.get(session, task_id=task_id)
    try:
        tasks.cancel(session, task=task)
    except ServiceError as exc:
        session.rollback()
        return redirect(f"/tasks/{task_id}", flash=exc.message, kind="error")
    _wake_scheduler(request)
    return redirect(f"/tasks/{task_id}", flash=f"Task {task_id} cancelled.")


@router.get("/resource-groups", response_class=HTMLResponse)
def resource_group_list(request: Request, session: SessionDep) -> Response:
    """Resource groups with their capacity and use, and the agents serving them."""
    return render(request, "resource_groups.html", views.resource_groups_page(session))
