"""Resource group management (admins) and capacity accounting (the scheduler).

A group's free workers are `min(capacity, workers of its online active agents)`
less the compute workers held by allocations (an agent an admin drains or
disables keeps the workers it runs and offers no new ones); draining, disabled
and deleted groups offer none.
"""

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend.agents.models import Agent, AgentState
from backend.core.db import utcnow
from backend.core.errors import Conflict, Invalid, NotFound
from backend.resource_groups.models import GroupState, ResourceGroup
from backend.resource_groups.schemas import (
    LABEL_KEY,
    ResourceGroupCreate,
    ResourceGroupRead,
    ResourceGroupUpdate,
)
from backend.tasks.models import Allocation, NodeRole, SubTask, Task, TaskStatus
from backend.tasks.spec import parse_spec

LIVE = ResourceGroup.deleted_at.is_(None)
UNFINISHED = [TaskStatus.QUEUED, TaskStatus.SCHEDULED, TaskStatus.RUNNING, TaskStatus.RESTARTING]


@dataclass
class GroupFree:
    """A live group's state for placement: free workers now (0 unless active)."""

    id: int
    name: str
    device_type: str
    state: GroupState
    capacity: int
    online: int
    held: int
    labels: dict[str, Any] = field(default_factory=dict)
    held_inactive: int = 0  # of `held`, workers run by agents an admin drained or disabled

    @property
    def free(self) -> int:
        if self.state is not GroupState.ACTIVE:
            return 0
        return max(0, min(self.capacity - self.held,
                          self.online - (self.held - self.held_inactive)))

    def matches(self, labels: dict[str, str]) -> bool:
        return all(self.labels.get(k) == v for k, v in labels.items())


def get_by_name(session: Session, *, name: str) -> ResourceGroup:
    """The live group called `name`. Raises NotFound naming it."""
    group = session.scalar(select(ResourceGroup).where(ResourceGroup.name == name, LIVE))
    if group is None:
        raise NotFound(f"resource group '{name}' does not exist", field="name")
    return group


def _check_labels(labels: dict[str, str] | None) -> None:
    for key, value in (labels or {}).items():
        if not re.match(LABEL_KEY, key) or len(value) > 200:
            raise Invalid(f"label '{key}' is not a valid key (letters, digits, _ . - /) "
                          f"with a value of at most 200 characters", field=f"labels.{key}")


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
    """
    changes = data.model_dump(exclude_unset=True, exclude_none=True)
    _check_labels(changes.get("labels"))
    running = running_tasks(session, group_id=group.id)
    if changes.get("state") is GroupState.DISABLED and running:
        raise Conflict(f"resource group '{group.name}' still runs {running} task(s); "
                       f"set state 'draining' first and disable it once they end", field="state")
    if changes.get("device_type", group.device_type) != group.device_type and in_use(
            session, group=group):
        raise Conflict(f"resource group '{group.name}' is in use; its device type cannot change",
                       field="device_type")
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
        raise Conflict(f"resource group '{group.name}' is in use by a task that has not ended; "
                       f"drain it and wait for its tasks to end", field="name")
    agents = online_agents(session, group_id=group.id)
    if agents:
        raise Conflict(f"resource group '{group.name}' has {len(agents)} agent(s) online; "
                       f"stop them first", field="name")
    group.deleted_at, group.state = utcnow(), GroupState.DISABLED
    session.commit()


def in_use(session: Session, *, group: ResourceGroup) -> bool:
    """True if a task that has not ended names the group or holds nodes on it."""
    if running_tasks(session, group_id=group.id):
        return True
    # Queued tasks name their groups in the spec: scan only the unfinished ones.
    specs = session.scalars(select(Task.spec).where(Task.status.in_(UNFINISHED)))
    return any(group.name in parse_spec(spec).named_groups() for spec in specs)


def running_tasks(session: Session, *, group_id: int) -> int:
    """Tasks holding nodes on the group now."""
    return session.scalar(
        select(func.count(func.distinct(Allocation.task_id))).where(
            Allocation.resource_group_id == group_id, Allocation.released_at.is_(None))
    ) or 0


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
    """The group's online agents, whatever their admin state."""
    return list(
        session.scalars(
            select(Agent).where(Agent.resource_group_id == group_id, Agent.online.is_(True))
        )
    )


ALLOCATION_LOCK = 0x706F6C79  # "poly": the advisory lock key of allocation


def lock_allocation(session: Session) -> None:
    """Take the allocation lock until the transaction ends (PostgreSQL advisory lock).

    Every allocation holds it while it reads free capacity and books nodes,
    so two schedulers (threads or API processes) never book the same free
    workers; releases need no lock (they only add free workers). On SQLite
    a no-op: its writers are serialised and the embedded default runs one
    scheduler.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_advisory_xact_lock(ALLOCATION_LOCK)))


# Per-group totals, each computed once for all groups (one scan, not one per group).
_ONLINE = (select(Agent.resource_group_id.label("group_id"),
                  func.sum(Agent.workers).label("workers"))
           .where(Agent.online.is_(True), Agent.state == AgentState.ACTIVE)
           .group_by(Agent.resource_group_id).subquery("online"))
_HELD = (select(Allocation.resource_group_id.label("group_id"),
                func.count(Allocation.id).label("nodes"))
         .where(Allocation.released_at.is_(None), Allocation.role == NodeRole.COMPUTE)
         .group_by(Allocation.resource_group_id).subquery("held"))
# Driven from the (few) agents an admin drained or disabled: nothing to join while all are
# active.
_HELD_INACTIVE = (
    select(SubTask.resource_group_id.label("group_id"),
           func.count(Allocation.id).label("nodes"))
    .select_from(Agent)
    .join(SubTask, SubTask.agent_id == Agent.id)
    .join(Allocation, (Allocation.task_id == SubTask.task_id)
          & (Allocation.attempt == SubTask.attempt)
          & (Allocation.resource_group_id == SubTask.resource_group_id))
    .where(Agent.state != AgentState.ACTIVE, Allocation.released_at.is_(None),
           Allocation.role == NodeRole.COMPUTE)
    .group_by(SubTask.resource_group_id).subquery("held_inactive"))
FREE = (
    select(ResourceGroup.id, ResourceGroup.name, ResourceGroup.device_type,
           ResourceGroup.state, ResourceGroup.capacity, ResourceGroup.labels,
           func.coalesce(_ONLINE.c.workers, 0), func.coalesce(_HELD.c.nodes, 0),
           func.coalesce(_HELD_INACTIVE.c.nodes, 0))
    .outerjoin(_ONLINE, _ONLINE.c.group_id == ResourceGroup.id)
    .outerjoin(_HELD, _HELD.c.group_id == ResourceGroup.id)
    .outerjoin(_HELD_INACTIVE, _HELD_INACTIVE.c.group_id == ResourceGroup.id)
    .where(LIVE)
)


def free_capacity(session: Session, group_ids: Iterable[int] | None = None
                  ) -> dict[str, GroupFree]:
    """Each live group's free workers, by name, in one statement (held nodes by a partial index).

    Run after `lock` it sees every allocation committed before the lock was
    granted (PostgreSQL takes a new snapshot per statement).
    """
    query = FREE
    if group_ids is not None:
        query = query.where(ResourceGroup.id.in_(list(group_ids)))
    return free_from_rows(session.execute(query))


def free_from_rows(rows: Iterable[Sequence[Any]]) -> dict[str, GroupFree]:
    """`GroupFree` by name from rows of `FREE`, typed by SQLAlchemy or as the driver returns
    them (the state's stored name, labels as JSON text or decoded)."""
    free = {}
    for (id_, name, device_type, state, capacity, labels, online, held, held_inactive) in rows:
        if isinstance(labels, str):
            labels = json.loads(labels)
        free[name] = GroupFree(
            id=id_, name=name, device_type=device_type,
            state=state if isinstance(state, GroupState) else GroupState[state],
            capacity=capacity, online=int(online), held=int(held), labels=dict(labels or {}),
            held_inactive=int(held_inactive))
    return free


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
