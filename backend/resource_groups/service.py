"""Resource group management (admins); a group's free workers are the scheduler's
(:mod:`backend.scheduler.capacity`)."""

import re

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend.agents.models import Agent
from backend.core.db import utcnow
from backend.core.errors import Conflict, Invalid, NotFound
from backend.resource_groups.models import LIVE, GroupState, ResourceGroup
from backend.resource_groups.schemas import (
    LABEL_KEY,
    ResourceGroupCreate,
    ResourceGroupRead,
    ResourceGroupUpdate,
)
from backend.scheduler.capacity import allocated_workers, free_capacity
from backend.tasks.models import TERMINAL, Allocation, Task
from backend.tasks.spec import parse_spec


def get_by_name(session: Session, *, name: str) -> ResourceGroup:
    """The live group called `name`. Raises NotFound naming it."""
    group = session.scalar(select(ResourceGroup).where(ResourceGroup.name == name, LIVE))
    if group is None:
        raise NotFound(f"resource group '{name}' does not exist", field="name")
    return group


def _check_labels(labels: dict[str, str] | None) -> None:
    for key, value in (labels or {}).items():
        if not re.match(LABEL_KEY, key) or len(value) > 200:
            raise Invalid(
                f"label '{key}' is not a valid key (letters, digits, _ . - /) "
                f"with a value of at most 200 characters",
                field=f"labels.{key}",
            )


def create(session: Session, *, data: ResourceGroupCreate) -> ResourceGroup:
    """Create a group. Raises Conflict if the name is taken, Invalid for a bad label."""
    _check_labels(data.labels)
    if session.scalar(select(ResourceGroup.id).where(ResourceGroup.name == data.name, LIVE)):
        raise Conflict(f"resource group '{data.name}' already exists", field="name")
    group = ResourceGroup(**data.model_dump())
    session.add(group)
    session.commit()
    return group


def update(session: Session, *, group: ResourceGroup, data: ResourceGroupUpdate) -> ResourceGroup:
    """Change a group's fields or state.

    Raises:
        Invalid: a bad label.
        Conflict: disabling a group that still runs tasks (drain it first), or
            changing the device type of a group in use.

    `accepted_models` replaces the list: adding a model widens the group; removing one
    refuses that model's next registrations (agents online stay).
    """
    changes = data.model_dump(exclude_unset=True, exclude_none=True)
    _check_labels(changes.get("labels"))
    running = running_tasks(session, group_id=group.id)
    if changes.get("state") is GroupState.DISABLED and running:
        raise Conflict(
            f"resource group '{group.name}' still runs {running} task(s); "
            f"set state 'draining' first and disable it once they end",
            field="state",
        )
    if changes.get("device_type", group.device_type) != group.device_type and in_use(
        session, group=group
    ):
        raise Conflict(
            f"resource group '{group.name}' is in use; its device type cannot change",
            field="device_type",
        )
    if changes.get("device_type", group.device_type) != group.device_type:
        changes.setdefault("accepted_models", [])  # the old type's models mean nothing now
    for key, value in changes.items():
        setattr(group, key, value)
    session.commit()
    return group


def delete(session: Session, *, group: ResourceGroup) -> None:
    """Delete a group; finished tasks keep naming it.

    Raises:
        Conflict: a task that has not ended asks for it or holds nodes on it,
            or an agent serving it is online.
    """
    if in_use(session, group=group):
        raise Conflict(
            f"resource group '{group.name}' is in use by a task that has not ended; "
            f"drain it and wait for its tasks to end",
            field="name",
        )
    agents = online_agents(session, group_id=group.id)
    if agents:
        raise Conflict(
            f"resource group '{group.name}' has {len(agents)} agent(s) online; stop them first",
            field="name",
        )
    group.deleted_at, group.state = utcnow(), GroupState.DISABLED
    session.commit()


def in_use(session: Session, *, group: ResourceGroup) -> bool:
    """True if a task that has not ended names the group or holds nodes on it."""
    if running_tasks(session, group_id=group.id):
        return True
    # Queued tasks name their groups in the spec: scan only the unfinished ones.
    specs = session.scalars(select(Task.spec).where(Task.status.not_in(TERMINAL)))
    return any(group.name in parse_spec(spec).named_groups() for spec in specs)


def running_tasks(session: Session, *, group_id: int) -> int:
    """Tasks holding nodes on the group now."""
    return (
        session.scalar(
            select(func.count(func.distinct(Allocation.task_id))).where(
                Allocation.resource_group_id == group_id, Allocation.released_at.is_(None)
            )
        )
        or 0
    )


def online_agents(session: Session, *, group_id: int) -> list[Agent]:
    """The group's online agents, whatever their admin state."""
    return list(
        session.scalars(
            select(Agent).where(Agent.resource_group_id == group_id, Agent.online.is_(True))
        )
    )


def read(session: Session, group: ResourceGroup) -> ResourceGroupRead:
    """The group with its live use: online agents, their workers, allocated and free workers."""
    agents = online_agents(session, group_id=group.id)
    state = free_capacity(session, [group.id]).get(group.name)
    return ResourceGroupRead.model_validate(group).model_copy(
        update={
            "agents_online": len(agents),
            "online_workers": sum(a.workers for a in agents),
            "allocated_workers": allocated_workers(session, group_id=group.id),
            "free_workers": state.free if state else 0,
            "running_tasks": running_tasks(session, group_id=group.id),
        }
    )


def list_all(session: Session) -> list[ResourceGroupRead]:
    groups = session.scalars(select(ResourceGroup).where(LIVE).order_by(ResourceGroup.name))
    return [read(session, g) for g in groups]
