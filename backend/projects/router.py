from typing import Annotated

from fastapi import APIRouter, Depends, Query, UploadFile, status

from backend.core.deps import SessionDep, SettingsDep
from backend.projects import service
from backend.projects.models import Project
from backend.projects.schemas import (
    CodeVersionCreate,
    CodeVersionRead,
    ProjectCreate,
    ProjectRead,
)

router = APIRouter(prefix="/projects", tags=["projects"])


def valid_project(project_id: int, session: SessionDep) -> Project:
    return service.get(session, project_id=project_id)


ProjectDep = Annotated[Project, Depends(valid_project)]


@router.get("", response_model=list[ProjectRead])
def list_projects(
    session: SessionDep, offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> list[Project]:
    return service.list_all(session, offset=offset, limit=limit)


@router.post("", response_model=ProjectRead, status_code=status.HTTP_201_CREATED)
def create_project(data: ProjectCreate, session: SessionDep) -> Project:
    return service.create(session, data=data)


@router.get("/{project_id}", response_model=ProjectRead)
def get_project(project: ProjectDep) -> Project:
    return project


@router.get("/{project_id}/code-versions", response_model=list[CodeVersionRead])
def list_code_versions(project: ProjectDep, session: SessionDep) -> list:
    return service.list_versions(session, project_id=project.id)


@router.post("/{project_id}/code-versions", response_model=CodeVersionRead,
             status_code=status.HTTP_201_CREATED)
def create_example_version(data: CodeVersionCreate, project: ProjectDep, session: SessionDep):
    """A new code version from a bundled example (`examples/NAME.py`)."""
    return service.add_example_version(session, project=project, example=data.example)


@router.post("/{project_id}/code-versions/upload", response_model=CodeVersionRead,
             status_code=status.HTTP_201_CREATED)
def upload_version(
    file: UploadFile, project: ProjectDep, session: SessionDep, settings: SettingsDep
):
    """Upload a `.py` training module; it is checked against the contract first."""
    content = file.file.read(settings.max_upload_bytes + 1)
    return service.add_uploaded_version(
        session, settings=settings, project=project, filename=file.filename or "", content=content
    )
