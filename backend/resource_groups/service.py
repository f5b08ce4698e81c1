"""Resource group management and capacity accounting."""

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend.agents.models import Agent
from backend.core.errors import Conflict, NotFound
from backend.resource_groups.models import ResourceGroup
from backend.resource_groups.schemas import (
    ResourceGroupCreate,
    ResourceGroupRead,
    ResourceGroupUpdate,
)
from backend.tasks.models import Allocation, NodeRole


def get_by_name(session: Session, *, name: str) -> ResourceGroup:
    """The group called `name`. Raises NotFound naming it."""
    group = session.scalar(select(ResourceGroup).where(ResourceGroup.name == name))
    if group is None:
        raise NotFound(f"resource group '{name}' does not exist", field="name")
    return group


def create(session: Session, *, data: ResourceGroupCreate) -> ResourceGroup:
    """Create a group. Raises Conflict if the name is taken."""
    if session.scalar(select(ResourceGroup).where(ResourceGroup.name == data.name)):
        raise Conflict(f"resource group '{data.name}' already exists", field="name")
    group = ResourceGroup(**data.model_dump())
    session.add(group)
    session.commit()
    return group


def update(session: Session, *, group: ResourceGroup, data: ResourceGroupUpdate) -> ResourceGroup:
    for key, value in data.model_dump(exclude_unset=True, exclude_none=True).items():
        setattr(group, key, value)
    session.commit()
    return group


def allocated_workers(session: Session, *, group_id: int) -> int:
    """Compute workers held by running or scheduled tasks on the group."""
    return session.scalar(
        select(func.count(Allocation.id)).where(
            Allocation.resource_group_id == group_id,
            Allocation.role == NodeRole.COMPUTE,
            Allocation.released_at.is_(None),
        )
    ) or 0


def online_agents(session: Session, *, group_id: int) -> list[Agent]:
    return list(
        session.scalars(
            select(Agent).where(Agent.resource_group_id == group_id, Agent.online.is_(True))
        )
    )


def read(session: Session, group: ResourceGroup) -> ResourceGroupRead:
    """The group with its live use: online agents, their workers, allocated workers."""
    agents = online_agents(session, group_id=group.id)
    return ResourceGroupRead.model_validate(group).model_copy(
        update={
            "agents_online": len(agents),
            "online_workers": sum(a.workers for a in agents),
            "allocated_workers": allocated_workers(session, group_id=group.id),
        }
    )


def list_all(session: Session) -> list[ResourceGroupRead]:
    groups = session.scalars(select(ResourceGroup).order_by(ResourceGroup.name))
    return [read(session, g) for g in groups]
