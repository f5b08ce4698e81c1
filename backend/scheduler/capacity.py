"""Capacity: each resource group's free workers, read under the allocation lock.

A group's free workers are `min(capacity, workers of its serving agents)` less
the compute workers held by allocations (an agent an admin drains or disables
keeps the workers it runs and offers no new ones: :data:`backend.agents.models.SERVING`);
draining, disabled and deleted groups offer none. A group spans its agents: each serving
agent's free workers are its `workers` less those of the parts (sub-tasks) booked for it
in the current attempts of active tasks, and a group never offers more than its agents'
free workers together (the booking splits a group's workers across them).
"""

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend.agents.models import SERVING, Agent, AgentState
from backend.resource_groups.models import LIVE, GroupState, ResourceGroup
from backend.tasks.models import ACTIVE, Allocation, NodeRole, SubTask, Task


@dataclass(frozen=True)
class AgentFree:
    """A serving agent's free workers: its `workers` less those booked for it."""

    id: int
    workers: int
    held: int

    @property
    def free(self) -> int:
        return max(0, self.workers - self.held)


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
    # Its serving agents, by id; None: not read (a group then counts as one unbound part).
    agents: list[AgentFree] | None = None

    @property
    def free(self) -> int:
        if self.state is not GroupState.ACTIVE:
            return 0
        free = min(self.capacity - self.held, self.online - (self.held - self.held_inactive))
        if self.agents is not None:
            free = min(free, sum(a.free for a in self.agents))
        return max(0, free)

    def matches(self, labels: dict[str, str]) -> bool:
        return all(self.labels.get(k) == v for k, v in labels.items())


def allocated_workers(session: Session, *, group_id: int) -> int:
    """Compute workers held by running or scheduled tasks on the group."""
    return (
        session.scalar(
            select(func.count(Allocation.id)).where(
                Allocation.resource_group_id == group_id,
                Allocation.role == NodeRole.COMPUTE,
                Allocation.released_at.is_(None),
            )
        )
        or 0
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
_ONLINE = (
    select(Agent.resource_group_id.label("group_id"), func.sum(Agent.workers).label("workers"))
    .where(SERVING)
    .group_by(Agent.resource_group_id)
    .subquery("online")
)
_HELD = (
    select(Allocation.resource_group_id.label("group_id"), func.count(Allocation.id).label("nodes"))
    .where(Allocation.released_at.is_(None), Allocation.role == NodeRole.COMPUTE)
    .group_by(Allocation.resource_group_id)
    .subquery("held")
)
# Driven from the (few) agents an admin drained or disabled: nothing to join while all are
# active.
_HELD_INACTIVE = (
    select(SubTask.resource_group_id.label("group_id"), func.count(Allocation.id).label("nodes"))
    .select_from(Agent)
    .join(SubTask, SubTask.agent_id == Agent.id)
    .join(
        Allocation,
        (Allocation.task_id == SubTask.task_id)
        & (Allocation.attempt == SubTask.attempt)
        & (Allocation.resource_group_id == SubTask.resource_group_id),
    )
    .where(
        Agent.state != AgentState.ACTIVE,
        Allocation.released_at.is_(None),
        Allocation.role == NodeRole.COMPUTE,
    )
    .group_by(SubTask.resource_group_id)
    .subquery("held_inactive")
)
FREE = (
    select(
        ResourceGroup.id,
        ResourceGroup.name,
        ResourceGroup.device_type,
        ResourceGroup.state,
        ResourceGroup.capacity,
        ResourceGroup.labels,
        func.coalesce(_ONLINE.c.workers, 0),
        func.coalesce(_HELD.c.nodes, 0),
        func.coalesce(_HELD_INACTIVE.c.nodes, 0),
    )
    .outerjoin(_ONLINE, _ONLINE.c.group_id == ResourceGroup.id)
    .outerjoin(_HELD, _HELD.c.group_id == ResourceGroup.id)
    .outerjoin(_HELD_INACTIVE, _HELD_INACTIVE.c.group_id == ResourceGroup.id)
    .where(LIVE)
)


# Workers booked for each agent: its parts in the current attempts of active tasks (their
# allocations are held until the task ends or restarts).
_AGENT_HELD = (
    select(SubTask.agent_id.label("agent_id"), func.sum(SubTask.workers).label("workers"))
    .join(Task, Task.id == SubTask.task_id)
    .where(
        Task.status.in_(sorted(ACTIVE)),
        SubTask.attempt == Task.attempt,
        SubTask.agent_id.is_not(None),
    )
    .group_by(SubTask.agent_id)
    .subquery("agent_held")
)
AGENTS = (
    select(
        Agent.resource_group_id,
        Agent.id,
        Agent.workers,
        func.coalesce(_AGENT_HELD.c.workers, 0),
    )
    .outerjoin(_AGENT_HELD, _AGENT_HELD.c.agent_id == Agent.id)
    .where(SERVING)
    .order_by(Agent.id)
)


def free_capacity(session: Session, group_ids: Iterable[int] | None = None) -> dict[str, GroupFree]:
    """Each live group's free workers, by name, with its serving agents' (two statements; held
    nodes by a partial index).

    Run after `lock` it sees every allocation committed before the lock was
    granted (PostgreSQL takes a new snapshot per statement).
    """
    query = FREE
    if group_ids is not None:
        query = query.where(ResourceGroup.id.in_(list(group_ids)))
    return free_from_rows(session.execute(query), session.execute(AGENTS))


def free_from_rows(
    rows: Iterable[Sequence[Any]], agent_rows: Iterable[Sequence[Any]]
) -> dict[str, GroupFree]:
    """`GroupFree` by name from rows of `FREE` and `AGENTS`, typed by SQLAlchemy or as the
    driver returns them (the state's stored name, labels as JSON text or decoded)."""
    agents: dict[int, list[AgentFree]] = {}
    for group_id, agent_id, workers, held in agent_rows:
        agents.setdefault(group_id, []).append(AgentFree(agent_id, int(workers), int(held)))
    free = {}
    for id_, name, device_type, state, capacity, labels, online, held, held_inactive in rows:
        if isinstance(labels, str):
            labels = json.loads(labels)
        free[name] = GroupFree(
            id=id_,
            name=name,
            device_type=device_type,
            state=state if isinstance(state, GroupState) else GroupState[state],
            capacity=capacity,
            online=int(online),
            held=int(held),
            labels=dict(labels or {}),
            held_inactive=int(held_inactive),
            agents=agents.get(id_, []),
        )
    return free
