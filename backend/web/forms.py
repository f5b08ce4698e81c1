"""HTML forms of the portal: raw entered values, their schemas, and errors keyed by field.

A form model holds what the user typed, as strings, so a refused form can be
shown again exactly as entered. Errors are a `{field: message}` dict; the key
`__all__` holds an error that belongs to no single field.
"""

import re
from typing import get_args

from fastapi import UploadFile
from pydantic import BaseModel, ValidationError
from sqlalchemy.orm import Session

from backend.core.config import Settings
from backend.core.errors import ServiceError
from backend.projects import service as projects
from backend.projects.models import CodeVersion, Project
from backend.projects.schemas import ProjectCreate
from backend.tasks import service as tasks
from backend.tasks.models import Task
from backend.tasks.schemas import TaskCreate

FieldErrors = dict[str, str]
FORM_ERROR = "__all__"
SPLIT_POLICIES: tuple[str, ...] = get_args(TaskCreate.model_fields["split_policy"].annotation)
_GROUP_FIELD = re.compile(r"^resource_groups\.(\d+)(\..*)?$")


class ProjectForm(BaseModel):
    """The create-project form as entered."""

    name: str = ""
    description: str = ""


class TaskForm(BaseModel):
    """The task submission form as entered; `group[i]` asks for `workers[i]` workers."""

    name: str = ""
    code_version_id: str = ""
    epochs: str = "5"
    global_batch_size: str = "64"
    split_policy: str = SPLIT_POLICIES[0]
    seed: str = "0"
    priority: str = "0"
    group: list[str] = []
    workers: list[str] = []

    def workers_of(self, group_name: str) -> str:
        """What was entered for `group_name` ("0" when the group was not in the form)."""
        return dict(zip(self.group, self.workers, strict=False)).get(group_name, "0")


def _message(text: str) -> str:
    # pydantic prefixes errors raised in validators; the prefix helps no user.
    return text.removeprefix("Value error, ")


def validation_errors(exc: ValidationError) -> FieldErrors:
    """The first message of each field of a pydantic error, keyed by dotted location."""
    errors: FieldErrors = {}
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or FORM_ERROR
        errors.setdefault(field, _message(error["msg"]))
    return errors


def service_errors(exc: ServiceError) -> FieldErrors:
    """A refused service call as a one-field error dict."""
    return {exc.field or FORM_ERROR: exc.message}


def create_project(session: Session, form: ProjectForm) -> tuple[Project | None, FieldErrors]:
    """Validate and create the project; on refusal return the errors instead."""
    try:
        data = ProjectCreate(name=form.name.strip(), description=form.description)
        return projects.create(session, data=data), {}
    except ValidationError as exc:
        return None, validation_errors(exc)
    except ServiceError as exc:
        session.rollback()
        return None, service_errors(exc)


def _group_requests(form: TaskForm) -> tuple[list[dict], FieldErrors]:
    """The groups asked for (workers > 0, blank = 0) and errors of unreadable entries."""
    requests, errors = [], {}
    for name, raw in zip(form.group, form.workers, strict=False):
        try:
            workers = int(raw.strip() or "0")
        except ValueError:
            errors[f"group.{name}"] = "enter a whole number of workers (0 = not used)"
            continue
        if workers != 0:
            requests.append({"name": name, "workers": workers})
    return requests, errors


def _to_group_fields(errors: FieldErrors, names: list[str]) -> FieldErrors:
    """Re-key `resource_groups.I...` errors to `group.NAME`, the form row they belong to."""
    keyed: FieldErrors = {}
    for field, message in errors.items():
        match = _GROUP_FIELD.match(field)
        if match and int(match.group(1)) < len(names):
            field = f"group.{names[int(match.group(1))]}"
        keyed.setdefault(field, message)
    return keyed


def _task_create(project_id: int, form: TaskForm) -> tuple[TaskCreate | None, FieldErrors]:
    requests, errors = _group_requests(form)
    if not requests and not errors:
        errors["resource_groups"] = "give at least one resource group some workers"
    payload = form.model_dump(exclude={"group", "workers"})
    payload.update(project_id=project_id, resource_groups=requests)
    try:
        data = TaskCreate.model_validate(payload)
    except ValidationError as exc:
        found = _to_group_fields(validation_errors(exc), [r["name"] for r in requests])
        return None, {**found, **errors}
    return (None, errors) if errors else (data, {})


def submit_task(
    session: Session, project: Project, form: TaskForm
) -> tuple[Task | None, FieldErrors]:
    """Validate the submission form and queue the task; on refusal return the errors."""
    data, errors = _task_create(project.id, form)
    if data is None:
        return None, errors
    try:
        return tasks.submit(session, data=data), {}
    except ServiceError as exc:
        session.rollback()
        names = [g.name for g in data.resource_groups]
        return None, _to_group_fields(service_errors(exc), names)


def add_example_version(
    session: Session, project: Project, example: str
) -> tuple[CodeVersion | None, FieldErrors]:
    """Add the bundled example `example` as a new code version, or return the error."""
    try:
        return projects.add_example_version(session, project=project, example=example), {}
    except ServiceError as exc:
        session.rollback()
        return None, service_errors(exc)


def add_uploaded_version(
    session: Session, settings: Settings, project: Project, upload: UploadFile | None
) -> tuple[CodeVersion | None, FieldErrors]:
    """Store an uploaded `.py` module as a new code version, or return the error."""
    if upload is None or not upload.filename:
        return None, {"file": "choose a .py file to upload"}
    content = upload.file.read(settings.max_upload_bytes + 1)
    try:
        version = projects.add_uploaded_version(
            session,
            settings=settings,
            project=project,
            filename=upload.filename,
            content=content,
        )
    except ServiceError as exc:
        session.rollback()
        return None, service_errors(exc)
    return version, {}
