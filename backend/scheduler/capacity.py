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
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Select, event, func, select
from sqlalchemy.orm import Session, SessionTransaction

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
_LOCAL = threading.Lock()  # SQLite: the allocation lock, between this process's threads
_HOLDS = "polytrain.allocation_lock"  # session.info: its transaction holds `_LOCAL`
LOCAL_WAIT_S = 60.0  # longest wait for `_LOCAL` (a leak would stall every booking)


def lock_allocation(session: Session) -> None:
    """Take the allocation lock until the transaction ends (PostgreSQL advisory lock).

    Every allocation holds it while it reads free capacity and books nodes,
    so two schedulers (threads or API processes) never book the same free
    workers; releases need no lock (they only add free workers). On SQLite,
    whose embedded default runs one API process (one scheduler), a lock of the
    process's threads: the scheduler and a request that books too (a shrunk task
    taken in again at an epoch end, :mod:`backend.scheduler.regrow`) take turns,
    each from its capacity read to its commit (SQLite reads outside a transaction,
    so its serialised writers alone would not keep a read from going stale).

    Raises:
        TimeoutError: (SQLite) another thread held the lock for `LOCAL_WAIT_S`.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_advisory_xact_lock(ALLOCATION_LOCK)))
        return
    if session.info.get(_HOLDS):
        return
    session.connection()  # a transaction to end: its end releases the lock
    if not _LOCAL.acquire(timeout=LOCAL_WAIT_S):
        raise TimeoutError(f"the allocation lock was held for {LOCAL_WAIT_S:.0f} s")
    session.info[_HOLDS] = True
    if not event.contains(session, "after_transaction_end", _release_local):
        event.listen(session, "after_transaction_end", _release_local)


def _release_local(session: Session, transaction: SessionTransaction) -> None:
    """Release `_LOCAL` when the transaction that took it ends (commit, rollback, close)."""
    if transaction.parent is None and session.info.pop(_HOLDS, False):
        _LOCAL.release()


def _free_query(returned_by: int | None = None) -> Select[Any]:
    """Each live group's row for `GroupFree` (`FREE`); `returned_by`: that task's nodes are
    not counted as held."""
    mine = () if returned_by is None else (Allocation.task_id != returned_by,)
    # Per-group totals, each computed once for all groups (one scan, not one per group).
    online = (
        select(Agent.resource_group_id.label("group_id"), func.sum(Agent.workers).label("workers"))
        .where(SERVING)
        .group_by(Agent.resource_group_id)
        .subquery("online")
    )
    held = (
        select(
            Allocation.resource_group_id.label("group_id"), func.count(Allocation.id).label("nodes")
        )
        .where(Allocation.released_at.is_(None), Allocation.role == NodeRole.COMPUTE, *mine)
        .group_by(Allocation.resource_group_id)
        .subquery("held")
    )
    # Driven from the (few) agents an admin drained or disabled: nothing to join while all are
    # active.
    held_inactive = (
        select(
            SubTask.resource_group_id.label("group_id"), func.count(Allocation.id).label("nodes")
        )
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
            *mine,
        )
        .group_by(SubTask.resource_group_id)
        .subquery("held_inactive")
    )
    return (
        select(
            ResourceGroup.id,
            ResourceGroup.name,
            ResourceGroup.device_type,
            ResourceGroup.state,
            ResourceGroup.capacity,
            ResourceGroup.labels,
            func.coalesce(online.c.workers, 0),
            func.coalesce(held.c.nodes, 0),
            func.coalesce(held_inactive.c.nodes, 0),
        )
        .outerjoin(online, online.c.group_id == ResourceGroup.id)
        .outerjoin(held, held.c.group_id == ResourceGroup.id)
        .outerjoin(held_inactive, held_inactive.c.group_id == ResourceGroup.id)
        .where(LIVE)
    )


def _agents_query(returned_by: int | None = None) -> Select[int, int, int, Any]:
    """Each serving agent's row for `AgentFree` (`AGENTS`); `returned_by`: that task's parts
    are not counted as booked."""
    mine = () if returned_by is None else (SubTask.task_id != returned_by,)
    # Workers booked for each agent: its parts in the current attempts of active tasks (their
    # allocations are held until the task ends or restarts).
    agent_held = (
        select(SubTask.agent_id.label("agent_id"), func.sum(SubTask.workers).label("workers"))
        .join(Task, Task.id == SubTask.task_id)
        .where(
            Task.status.in_(sorted(ACTIVE)),
            SubTask.attempt == Task.attempt,
            SubTask.agent_id.is_not(None),
            *mine,
        )
        .group_by(SubTask.agent_id)
        .subquery("agent_held")
    )
    return (
        select(
            Agent.resource_group_id,
            Agent.id,
            Agent.workers,
            func.coalesce(agent_held.c.workers, 0),
        )
        .outerjoin(agent_held, agent_held.c.agent_id == Agent.id)
        .where(SERVING)
        .order_by(Agent.id)
    )


FREE = _free_query()
AGENTS = _agents_query()


def free_capacity(
    session: Session, group_ids: Iterable[int] | None = None, *, returned_by: int | None = None
) -> dict[str, GroupFree]:
    """Each live group's free workers, by name, with its serving agents' (two statements; held
    nodes by a partial index).

    Run after `lock` it sees every allocation committed before the lock was
    granted (PostgreSQL takes a new snapshot per statement). `returned_by` (a task id): its
    nodes and parts count as free, as they would be once it restarted (placing a running
    task again: :mod:`backend.scheduler.regrow`).
    """
    query = FREE if returned_by is None else _free_query(returned_by)
    if group_ids is not None:
        query = query.where(ResourceGroup.id.in_(list(group_ids)))
    agents = AGENTS if returned_by is None else _agents_query(returned_by)
    return free_from_rows(session.execute(query), session.execute(agents))


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
