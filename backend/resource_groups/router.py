from fastapi import APIRouter, status

from backend.core.deps import SessionDep
from backend.resource_groups import service
from backend.resource_groups.schemas import (
    ResourceGroupCreate,
    ResourceGroupRead,
    ResourceGroupUpdate,
)

router = APIRouter(prefix="/resource-groups", tags=["resource groups"])


@router.get("", response_model=list[ResourceGroupRead])
def list_groups(session: SessionDep) -> list[ResourceGroupRead]:
    return service.list_all(session)


@router.post("", response_model=ResourceGroupRead, status_code=status.HTTP_201_CREATED)
def create_group(data: ResourceGroupCreate, session: SessionDep) -> ResourceGroupRead:
    return service.read(session, service.create(session, data=data))


@router.get("/{name}", response_model=ResourceGroupRead)
def get_group(name: str, session: SessionDep) -> ResourceGroupRead:
    return service.read(session, service.get_by_name(session, name=name))


@router.patch("/{name}", response_model=ResourceGroupRead)
def update_group(name: str, data: ResourceGroupUpdate, session: SessionDep) -> ResourceGroupRead:
    group = service.update(session, group=service.get_by_name(session, name=name), data=data)
    return service.read(session, group)
