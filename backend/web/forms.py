"""HTML forms of the portal: raw entered values, their schemas, and errors keyed by field.

A form model holds what the user typed, as strings, so a refused form can be
shown again exactly as entered. Errors are a `{field: message}` dict; the key
`__all__` holds an error that belongs to no single field.
"""

from fastapi import UploadFile
from pydantic import BaseModel, ValidationError
from sqlalchemy.orm import Session

from backend.core.config import Settings
from backend.core.errors import ServiceError
from backend.projects import service as projects
from backend.projects.models import CodeVersion, Project
from backend.projects.schemas import ProjectCreate, ProjectUpdate

FieldErrors = dict[str, str]
FORM_ERROR = "__all__"


class ProjectForm(BaseModel):
    """The create- or edit-project form as entered."""

    name: str = ""
    description: str = ""


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


def create_project(
    session: Session, form: ProjectForm, owner_id: int
) -> tuple[Project | None, FieldErrors]:
    """Validate and create the project; on refusal return the errors instead."""
    try:
        data = ProjectCreate(name=form.name.strip(), description=form.description)
        return projects.create(session, data=data, owner_id=owner_id), {}
    except ValidationError as exc:
        return None, validation_errors(exc)
    except ServiceError as exc:
        session.rollback()
        return None, service_errors(exc)


def update_project(session: Session, project: Project, form: ProjectForm) -> FieldErrors:
    """Rename and re-describe the project; on refusal return the errors."""
    try:
        data = ProjectUpdate(name=form.name.strip(), description=form.description)
        projects.update(session, project=project, data=data)
    except ValidationError as exc:
        return validation_errors(exc)
    except ServiceError as exc:
        session.rollback()
        return service_errors(exc)
    return {}


def add_example_version(
    session: Session, project: Project, example: str, user_id: int | None = None
) -> tuple[CodeVersion | None, FieldErrors]:
    """Add the bundled example `example` as a new code version (added by `user_id`), or
    return the error."""
    try:
        version = projects.add_example_version(
            session, project=project, example=example, uploaded_by_id=user_id
        )
        return version, {}
    except ServiceError as exc:
        session.rollback()
        return None, service_errors(exc)


def add_uploaded_version(
    session: Session,
    settings: Settings,
    project: Project,
    upload: UploadFile | None,
    entrypoint: str = "",
    requirements: str = "",
    user_id: int | None = None,
) -> tuple[CodeVersion | None, FieldErrors, int]:
    """Store an uploaded module or archive (with a module's requirements, if any) as a new
    code version uploaded by `user_id`, or return the error and its HTTP status (413 too
    large, 415 not Python, 422 breaks the contract or refused requirements, 503 the package
    index too slow)."""
    if upload is None or not upload.filename:
        return None, {"file": "choose a .py module or a .zip / .tar.gz archive to upload"}, 422
    content = upload.file.read(settings.max_upload_bytes + 1)
    try:
        version = projects.add_uploaded_version(
            session,
            settings=settings,
            project=project,
            filename=upload.filename,
            content=content,
            entrypoint=entrypoint.strip() or None,
            requirements=requirements or None,
            uploaded_by_id=user_id,
        )
    except ServiceError as exc:
        session.rollback()
        return None, service_errors(exc), exc.status
    return version, {}, 201
