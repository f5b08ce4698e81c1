from fastapi import APIRouter, Response, status

from backend.auth.dependencies import AdminWrites
from backend.core.dependencies import SessionDep
from backend.core.pagination import Page, paginated
from backend.resource_groups import service
from backend.resource_groups.schemas import (
    ResourceGroupCreate,
    ResourceGroupRead,
    ResourceGroupUpdate,
)

# Every user reads groups (to submit tasks); only admins create, edit, drain or delete them.
router = APIRouter(prefix="/resource-groups", tags=["resource groups"], dependencies=[AdminWrites])


@router.get("", response_model=list[ResourceGroupRead])
def list_groups(session: SessionDep, page: Page, response: Response) -> list[ResourceGroupRead]:
    return paginated(service.list_all(session), page, response)


@router.post("", response_model=ResourceGroupRead, status_code=status.HTTP_201_CREATED)
def create_group(data: ResourceGroupCreate, session: SessionDep) -> ResourceGroupRead:
    return service.read(session, service.create(session, data=data))


@router.get("/{name}", response_model=ResourceGroupRead)
def get_group(name: str, session: SessionDep) -> ResourceGroupRead:
    return service.read(session, service.get_by_name(session, name=name))


@router.patch("/{name}", response_model=ResourceGroupRead)
def update_group(name: str, data: ResourceGroupUpdate, session: SessionDep) -> ResourceGroupRead:
    """Edit a group; `{"state": "draining"}` drains it, `"disabled"` disables it once empty."""
    group = service.update(session, group=service.get_by_name(session, name=name), data=data)
    return service.read(session, group)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT)
def delete_group(name: str, session: SessionDep) -> None:
    """Delete a group; 409 while a task that has not ended uses it or an agent serves it."""
    service.delete(session, group=service.get_by_name(session, name=name))
