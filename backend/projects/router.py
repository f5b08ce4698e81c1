"""REST for projects, their members and code versions; every route checks access."""

from typing import Annotated

from fastapi import APIRouter, Depends, Form, Query, Response, UploadFile, status
from fastapi.responses import PlainTextResponse

from backend.auth.dependencies import CurrentUser, UserAuth
from backend.core.dependencies import SessionDep, SettingsDep
from backend.core.errors import ErrorResponse
from backend.core.pagination import TOTAL_HEADER, Page, paginated
from backend.projects import access, files, service
from backend.projects.models import CodeVersion, Project
from backend.projects.requirements import MAX_REQUIREMENTS_CHARS
from backend.projects.schemas import (
    SHARED_MESSAGE,
    CodeFileRead,
    CodeVersionCreate,
    CodeVersionRead,
    MemberAdd,
    MemberRead,
    ProjectCreate,
    ProjectRead,
    ProjectUpdate,
    ShareResult,
)

router = APIRouter(prefix="/projects", tags=["projects"], dependencies=[UserAuth])


def valid_project(project_id: int, session: SessionDep, user: CurrentUser) -> Project:
    """A project the caller may see (404 otherwise)."""
    return access.readable_project(session, user=user, project_id=project_id)


def writable_project(project_id: int, session: SessionDep, user: CurrentUser) -> Project:
    """A project the caller may add code and tasks to (404; 409 when archived)."""
    return access.writable_project(session, user=user, project_id=project_id)


def managed_project(project_id: int, session: SessionDep, user: CurrentUser) -> Project:
    """A project the caller owns, or any project for an admin (404; 403 for a member)."""
    return access.managed_project(session, user=user, project_id=project_id)


ProjectDep = Annotated[Project, Depends(valid_project)]
WritableProjectDep = Annotated[Project, Depends(writable_project)]
ManagedProjectDep = Annotated[Project, Depends(managed_project)]


def project_version(version_id: int, project: ProjectDep, session: SessionDep) -> CodeVersion:
    """A code version of a project the caller may see (404 otherwise)."""
    return service.project_version(session, project=project, version_id=version_id)


VersionDep = Annotated[CodeVersion, Depends(project_version)]


@router.get("", response_model=list[ProjectRead])
def list_projects(
    session: SessionDep,
    user: CurrentUser,
    response: Response,
    offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    include_archived: Annotated[bool, Query(description="list archived projects too")] = True,
) -> list[Project]:
    """The projects the caller owns or is a member of (every project for an admin)."""
    ids = access.visible_project_ids(session, user=user)
    response.headers[TOTAL_HEADER] = str(
        service.count(session, project_ids=ids, include_archived=include_archived)
    )
    return service.list_all(
        session, offset=offset, limit=limit, project_ids=ids, include_archived=include_archived
    )


@router.post("", response_model=ProjectRead, status_code=status.HTTP_201_CREATED)
def create_project(data: ProjectCreate, session: SessionDep, user: CurrentUser) -> Project:
    """A new project owned by the caller (names are unique per owner)."""
    return service.create(session, data=data, owner_id=user.id)


@router.get("/{project_id}", response_model=ProjectRead)
def get_project(project: ProjectDep) -> Project:
    return project


@router.patch("/{project_id}", response_model=ProjectRead)
def update_project(data: ProjectUpdate, project: ManagedProjectDep, session: SessionDep) -> Project:
    """Rename or re-describe a project (owner or admin)."""
    return service.update(session, project=project, data=data)


@router.post("/{project_id}/archive", response_model=ProjectRead)
def archive_project(project: ManagedProjectDep, session: SessionDep) -> Project:
    """Archive a project: it stays readable, but takes no new code versions or tasks."""
    return service.set_archived(session, project=project, archived=True)


@router.post("/{project_id}/unarchive", response_model=ProjectRead)
def unarchive_project(project: ManagedProjectDep, session: SessionDep) -> Project:
    return service.set_archived(session, project=project, archived=False)


@router.get("/{project_id}/members", response_model=list[MemberRead])
def list_members(project: ProjectDep, session: SessionDep, page: Page, response: Response) -> list:
    """The project's owner and members."""
    return paginated(service.member_rows(session, project=project), page, response)


@router.post(
    "/{project_id}/members", response_model=ShareResult, status_code=status.HTTP_202_ACCEPTED
)
def add_member(data: MemberAdd, project: ManagedProjectDep, session: SessionDep) -> ShareResult:
    """Share the project with the account that has this email (owner or admin).

    The answer is the same whether or not such an account exists (no email enumeration);
    `GET .../members` lists who can see the project.
    """
    service.share(session, project=project, email=data.email)
    return ShareResult(email=data.email.strip().lower(), message=SHARED_MESSAGE)


@router.delete("/{project_id}/members/{user_id}", status_code=status.HTTP_204_NO_CONTENT)
def remove_member(user_id: int, project: ManagedProjectDep, session: SessionDep) -> Response:
    """Stop sharing the project with a user (owner or admin)."""
    service.remove_member(session, project=project, user_id=user_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/{project_id}/code-versions", response_model=list[CodeVersionRead])
def list_code_versions(
    project: ProjectDep, session: SessionDep, page: Page, response: Response
) -> list:
    """The project's code versions, newest first."""
    return paginated(service.list_versions(session, project_id=project.id), page, response)


@router.get("/{project_id}/code-versions/{version_id}/files", response_model=list[CodeFileRead])
def list_code_files(version: VersionDep, page: Page, response: Response) -> list:
    """The code version's files by path: a module's one file, or each file of an archive
    (read in place, never unpacked)."""
    return paginated(files.list_files(version), page, response)


@router.get(
    "/{project_id}/code-versions/{version_id}/files/{path:path}",
    response_class=Response,  # text/plain (below); errors keep the JSON shape
    responses={
        200: {
            "content": {"text/plain": {"example": "def build_model():\n    ...\n"}},
            "description": "the file's source, UTF-8 text",
        },
        413: {
            "model": ErrorResponse,
            "description": f"the file is over {files.MAX_SHOWN_BYTES} bytes (1 MiB)",
        },
        415: {"model": ErrorResponse, "description": "a binary file, not UTF-8 text"},
    },
)
def read_code_file(path: str, version: VersionDep) -> PlainTextResponse:
    """The text of one file of the code version, by its path in the file list (e.g.
    `train.py`, `pkg/model.py`). 404 for a path the version does not have, 422 for one
    that is not a relative path inside it (`..`, absolute), 415 for a binary file, 413 for
    a file over 1 MiB."""
    return PlainTextResponse(files.read_text(version, path), media_type="text/plain")


@router.post(
    "/{project_id}/code-versions",
    response_model=CodeVersionRead,
    status_code=status.HTTP_201_CREATED,
)
def create_example_version(
    data: CodeVersionCreate, project: WritableProjectDep, session: SessionDep, user: CurrentUser
) -> CodeVersion:
    """A new code version from a bundled example (`examples/NAME.py`)."""
    return service.add_example_version(
        session, project=project, example=data.example, uploaded_by_id=user.id
    )


@router.post(
    "/{project_id}/code-versions/upload",
    response_model=CodeVersionRead,
    status_code=status.HTTP_201_CREATED,
    responses={
        413: {"model": ErrorResponse, "description": "the file is over the upload limit"},
        415: {
            "model": ErrorResponse,
            "description": "neither a .py module nor a .zip/.tar.gz archive",
        },
        503: {
            "model": ErrorResponse,
            "description": "the package index did not answer in time (requirements)",
        },
    },
)
def upload_version(
    file: UploadFile,
    project: WritableProjectDep,
    session: SessionDep,
    settings: SettingsDep,
    user: CurrentUser,
    entrypoint: Annotated[
        str | None,
        Form(
            max_length=300,
            examples=["train.py"],
            description=(
                "for an archive: the module with the contract's functions "
                "(default train.py, main.py or the only .py file)"
            ),
        ),
    ] = None,
    requirements: Annotated[
        str | None,
        Form(
            max_length=MAX_REQUIREMENTS_CHARS,
            examples=["einops>=0.8\ntorch-optimizer\n"],
            description=(
                "for a module: its own Python packages, a requirements.txt text (names on the "
                "package index with version specs; no options, URLs or paths). An archive "
                "declares them in its own requirements.txt or pyproject.toml instead"
            ),
        ),
    ] = None,
) -> CodeVersion:
    """Upload a `.py` training module, or a `.zip`/`.tar.gz` archive with an entrypoint
    module; each upload is a new immutable version, checked against the contract first.

    Declared requirements (the `requirements` field beside a module, or an archive's
    requirements.txt / pyproject.toml) are resolved now into a lock of the packages the
    platform lacks; one that cannot be resolved, or would replace a platform package such
    as torch, is refused (422, field `requirements`) and nothing is stored."""
    content = file.file.read(settings.max_upload_bytes + 1)
    return service.add_uploaded_version(
        session,
        settings=settings,
        project=project,
        filename=file.filename or "",
        content=content,
        entrypoint=entrypoint or None,
        requirements=requirements or None,
        uploaded_by_id=user.id,
    )
