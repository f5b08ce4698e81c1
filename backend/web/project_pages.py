"""Portal pages of projects: list and create, one project with its code, members and the
task submission form; edit, archive and share (owner or admin)."""

from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import Response
from pydantic import ValidationError

from backend.auth.dependencies import CsrfCheck, WebUser
from backend.auth.models import User
from backend.core.dependencies import SessionDep, SettingsDep
from backend.core.errors import Invalid, NotFound, ServiceError
from backend.projects import access as project_access
from backend.projects import service as projects
from backend.projects.models import Project
from backend.projects.schemas import SHARED_MESSAGE, MemberAdd
from backend.tasks import access as task_access
from backend.web import forms, views
from backend.web.forms import ProjectForm, validation_errors
from backend.web.task_form import TaskForm, form_from_task, not_in_form, submit_task
from backend.web.task_lists import ListQuery
from backend.web.templating import redirect, render
from contracts.packages import pins

router = APIRouter(include_in_schema=False)


def _project_page(
    request: Request,
    session: SessionDep,
    user: User,
    project: Project,
    *,
    status_code: int = 200,
    **context: Any,
) -> Response:
    page = views.project_page(session, user, project, **context)
    return render(request, "project.html", page, status_code=status_code)


@router.get("/projects")
def project_list(
    request: Request, session: SessionDep, user: WebUser, archived: bool = False
) -> Response:
    """The user's projects and the create-project form."""
    return render(
        request, "projects.html", views.projects_page(session, user, show_archived=archived)
    )


@router.post("/projects", dependencies=[CsrfCheck])
def create_project(
    request: Request, session: SessionDep, user: WebUser, form: Annotated[ProjectForm, Form()]
) -> Response:
    """Create a project owned by the user and open it; a refused one shows the form again."""
    project, errors = forms.create_project(session, form, owner_id=user.id)
    if project is None:
        status = 409 if "already exists" in errors.get("name", "") else 422
        context = views.projects_page(session, user, form, errors)
        return render(request, "projects.html", context, status_code=status)
    return redirect(f"/projects/{project.id}", flash=f"Project '{project.name}' created.")


@router.get("/projects/{project_id}")
def project_detail(
    request: Request,
    project_id: int,
    session: SessionDep,
    user: WebUser,
    query: Annotated[ListQuery, Query()],
    from_task: int | None = None,
) -> Response:
    """A project's code versions, members and tasks (filtered and paged by `query`), and the
    task submission form; with `from_task` ("Run again" on a task's page) the form filled
    from that task of the project, to change and submit as a new task (a plan's trial: back
    to its page, saying why)."""
    project = project_access.readable_project(session, user=user, project_id=project_id)
    if from_task is None:
        return _project_page(request, session, user, project, list_query=query)
    task = task_access.readable_task(session, user=user, task_id=from_task)
    if task.project_id != project.id:
        raise NotFound(f"task {from_task} does not exist", field="from_task")
    try:
        form = form_from_task(task)
    except ServiceError as exc:
        return redirect(f"/tasks/{task.id}", flash=exc.message, kind="error")
    return _project_page(
        request, session, user, project, form=form, from_task=task, not_in_form=not_in_form(task)
    )


@router.post("/projects/{project_id}/edit", dependencies=[CsrfCheck])
def edit_project(
    request: Request,
    project_id: int,
    session: SessionDep,
    user: WebUser,
    form: Annotated[ProjectForm, Form()],
) -> Response:
    project = project_access.managed_project(session, user=user, project_id=project_id)
    errors = forms.update_project(session, project, form)
    if errors:
        return _project_page(
            request, session, user, project, edit_form=form, edit_errors=errors, status_code=422
        )
    return redirect(f"/projects/{project.id}", flash="Project updated.")


@router.post("/projects/{project_id}/archive", dependencies=[CsrfCheck])
def archive_project(
    project_id: int, session: SessionDep, user: WebUser, archived: Annotated[str, Form()] = "true"
) -> Response:
    """Archive (read-only) or unarchive the project; `archived` is `true` or `false`."""
    project = project_access.managed_project(session, user=user, project_id=project_id)
    if archived not in ("true", "false"):
        raise Invalid("archived: choose true or false", field="archived")
    projects.set_archived(session, project=project, archived=archived == "true")
    word = "archived" if archived == "true" else "unarchived"
    return redirect(f"/projects/{project.id}", flash=f"Project '{project.name}' {word}.")


@router.post("/projects/{project_id}/members", dependencies=[CsrfCheck])
def add_member(
    request: Request,
    project_id: int,
    session: SessionDep,
    user: WebUser,
    email: Annotated[str, Form()] = "",
) -> Response:
    """Share the project with the account that has this email; the answer does not tell
    whether one has (no email enumeration)."""
    project = project_access.managed_project(session, user=user, project_id=project_id)
    try:
        data = MemberAdd(email=email.strip())
    except ValidationError as exc:
        return _project_page(
            request, session, user, project, member_errors=validation_errors(exc), status_code=422
        )
    projects.share(session, project=project, email=data.email)
    return redirect(
        f"/projects/{project.id}", flash=f"Shared with {data.email.lower()}: {SHARED_MESSAGE}."
    )


@router.post("/projects/{project_id}/members/{user_id}/remove", dependencies=[CsrfCheck])
def remove_member(project_id: int, user_id: int, session: SessionDep, user: WebUser) -> Response:
    project = project_access.managed_project(session, user=user, project_id=project_id)
    projects.remove_member(session, project=project, user_id=user_id)
    return redirect(f"/projects/{project.id}", flash="Member removed.")


@router.post("/projects/{project_id}/code-versions", dependencies=[CsrfCheck])
def add_example_version(
    request: Request,
    project_id: int,
    session: SessionDep,
    user: WebUser,
    example: Annotated[str, Form()] = "",
) -> Response:
    """Add a bundled example as the project's next code version."""
    project = project_access.writable_project(session, user=user, project_id=project_id)
    version, errors = forms.add_example_version(session, project, example, user.id)
    if version is None:
        return _project_page(
            request, session, user, project, errors=errors, example=example, status_code=422
        )
    return redirect(
        f"/projects/{project.id}",
        flash=f"Code version v{version.version} added ({version.filename}).",
    )


@router.post("/projects/{project_id}/code-versions/upload", dependencies=[CsrfCheck])
def upload_version(
    request: Request,
    project_id: int,
    session: SessionDep,
    settings: SettingsDep,
    user: WebUser,
    file: Annotated[UploadFile | None, File()] = None,
    entrypoint: Annotated[str, Form()] = "",
    requirements: Annotated[str, Form()] = "",
) -> Response:
    """Upload a `.py` module or an archive as the project's next code version; a module's
    requirements are resolved first (a refusal shows the form again as entered)."""
    project = project_access.writable_project(session, user=user, project_id=project_id)
    version, errors, status = forms.add_uploaded_version(
        session, settings, project, file, entrypoint, requirements, user.id
    )
    if version is None:
        return _project_page(
            request,
            session,
            user,
            project,
            errors=errors,
            entrypoint=entrypoint,
            requirements=requirements,
            status_code=status,
        )
    packages = f", {len(pins(version.lock))} packages locked" if version.lock else ""
    return redirect(
        f"/projects/{project.id}",
        flash=f"Code version v{version.version} added ({version.filename}{packages}).",
    )


@router.post("/projects/{project_id}/tasks", dependencies=[CsrfCheck])
def submit(
    request: Request,
    project_id: int,
    session: SessionDep,
    user: WebUser,
    form: Annotated[TaskForm, Form()],
) -> Response:
    """Queue a task from the submission form and open its page; refusals show inline."""
    project = project_access.writable_project(session, user=user, project_id=project_id)
    task, errors = submit_task(session, project, form, user.id)
    if task is None:
        return _project_page(
            request, session, user, project, form=form, errors=errors, status_code=422
        )
    return redirect(f"/tasks/{task.id}", flash=f"Task {task.id} submitted.")
