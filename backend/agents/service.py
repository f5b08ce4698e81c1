"""Agent registration and heartbeats."""

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend.agents.models import Agent, AgentState
from backend.agents.schemas import AgentRegister, AgentUpdate
from backend.agents.stamps import HeldStamps
from backend.core.db import utcnow
from backend.core.errors import Conflict, NotFound
from backend.resource_groups import service as groups
from backend.resource_groups.models import ResourceGroup
from backend.tasks import fate
from backend.tasks.models import SubTask, Task
from contracts.agent_api import Hardware


def register(session: Session, *, data: AgentRegister, live_within_s: float = 15.0) -> Agent:
    """Register (or re-register) the agent called `data.name` as online.

    The same agent restarted (same `instance_id`) takes its name back at
    once, and whatever it ran is restarted. Another process may take the
    name only once its holder is offline: deregistered, or silent for
    `live_within_s` seconds (the heartbeat timeout).

    The agent's hardware must match its group's (docs/architecture.md, "Homogeneous
    groups"): the same device type, and a device model the group accepts; a group that
    accepts none yet adopts this agent's model. A refused agent changes nothing.

    Raises:
        NotFound: the resource group does not exist (an admin creates groups).
        Conflict: (field `name`) a live agent with another instance id holds the name;
            (field `hardware.device_type` or `hardware.device_model`) the agent's hardware
            differs from its group's, naming both and what an admin can do.
    """
    group = groups.get_by_name(session, name=data.resource_group)
    _check_hardware(session, group, data.hardware)
    agent = session.scalar(select(Agent).where(Agent.name == data.name))
    if (
        agent is not None
        and _is_live(agent, live_within_s)
        and (data.instance_id is None or data.instance_id != agent.instance_id)
    ):
        silent = (utcnow() - agent.last_heartbeat_at).total_seconds()
        raise Conflict(
            f"agent name '{data.name}' is in use by a live agent on {agent.host} (last "
            f"heartbeat {max(0.0, silent):.0f} s ago); start this agent with another --name, "
            f"or stop that one first",
            field="name",
        )
    if agent is not None:
        # A process registering under a known name is a restarted agent: whatever it ran is gone.
        fate.restart_tasks_of(session, agent=agent, reason=f"agent '{agent.name}' restarted")
    if agent is None:
        agent = Agent(
            name=data.name, host=data.host, resource_group_id=group.id, workers=data.workers
        )
        session.add(agent)
    agent.host, agent.resource_group_id, agent.workers = data.host, group.id, data.workers
    agent.hardware = data.hardware.model_dump()
    if not group.accepted_models:
        group.accepted_models = [data.hardware.device_model]  # the first agent pins the group
    agent.online, agent.last_heartbeat_at = True, utcnow()
    agent.instance_id = data.instance_id
    session.commit()
    return agent


def _check_hardware(session: Session, group: ResourceGroup, hardware: Hardware) -> None:
    """Refuse (Conflict) an agent whose device type or model differs from `group`'s."""
    if hardware.device_type != group.device_type:
        missing = {"cuda": "a usable GPU", "npu": "a usable NPU (torch_npu)"}
        needs = missing.get(group.device_type, f"a {group.device_type} device")
        raise Conflict(
            f"resource group '{group.name}' is a {group.device_type} group but this agent's "
            f"hardware is {hardware.device_type} ({hardware.device_model}); a "
            f"{group.device_type} group needs {needs} on the agent's host: start the agent "
            f"on such a host, or join a {hardware.device_type} group",
            field="hardware.device_type",
        )
    if not group.accepted_models:
        # The first agent pins the model: lock the row so that two first agents serialize.
        session.refresh(group, with_for_update=True)
    accepted = group.accepted_models
    if accepted and hardware.device_model not in accepted:
        models = ", ".join(f"'{model}'" for model in accepted)
        raise Conflict(
            f"resource group '{group.name}' accepts device model(s) {models} but this agent's "
            f"is '{hardware.device_model}'; an admin can add '{hardware.device_model}' to the "
            f"group's accepted models (PATCH /api/v1/resource-groups/{group.name} with "
            f"accepted_models, or the cluster page) if it is interchangeable",
            field="hardware.device_model",
        )


def _is_live(agent: Agent, live_within_s: float) -> bool:
    """Online with a heartbeat within the last `live_within_s` seconds."""
    return agent.online and agent.last_heartbeat_at >= utcnow() - timedelta(seconds=live_within_s)


def get(session: Session, *, agent_id: int) -> Agent:
    """The agent `agent_id`. Raises NotFound (field `agent_id`) if unknown."""
    agent = session.get(Agent, agent_id)
    if agent is None:
        raise NotFound(f"agent {agent_id} is not registered", field="agent_id")
    return agent


def heartbeat(
    session: Session,
    *,
    agent: Agent,
    stamps: HeldStamps | None = None,
    at: datetime | None = None,
) -> Agent:
    """Record a heartbeat at `at` (naive UTC; now by default): the agent is online.

    With `stamps`, an agent that is online already writes nothing: its time is held there
    and written with the others' within a second (`backend.agents.stamps`); an agent that
    was offline (timed out, or deregistered) is written online at once. The caller commits
    when given `stamps`.
    """
    now = at or utcnow()
    if stamps is not None and agent.online:
        stamps.agent(agent.id, now)
        return agent
    agent.last_heartbeat_at, agent.online = now, True
    session.commit()
    return agent


def beat(
    session: Session,
    *,
    agent_id: int,
    stamps: HeldStamps,
    trust_s: float = 0.0,
    at: datetime | None = None,
) -> None:
    """`heartbeat` for the internal API, stamped `at` (the beat's arrival; now by default):
    an online agent's beat is held in `stamps`, without
    a database round trip when this process read the agent online within `trust_s` seconds
    (at most the liveness timeout: docs/architecture.md, "Monitoring"), else after reading
    one row's flag (no entity loaded); the caller commits. Raises NotFound (field
    `agent_id`) if unknown (once `trust_s` has passed since the row was last read)."""
    now = at or utcnow()
    if stamps.known_online(agent_id, trust_s):
        stamps.agent(agent_id, now)
        return
    online = session.scalar(select(Agent.online).where(Agent.id == agent_id))
    if online is None:
        raise NotFound(f"agent {agent_id} is not registered", field="agent_id")
    if online:
        stamps.agent(agent_id, now)
    else:
        heartbeat(session, agent=get(session, agent_id=agent_id), stamps=None, at=now)
    stamps.saw_online(agent_id)


def deregister(session: Session, *, agent: Agent, stamps: HeldStamps | None = None) -> None:
    """An agent that stops cleanly goes offline at once (its held stamp is dropped)."""
    if stamps is not None:
        stamps.forget_agent(agent.id)
    agent.online = False
    session.commit()


def list_all(
    session: Session, *, group: str | None = None, online: bool | None = None
) -> Sequence[Agent]:
    """Registered agents by name, optionally of one group or only (not) online."""
    query = select(Agent).order_by(Agent.name)
    if group is not None:
        query = query.where(Agent.resource_group_id == groups.get_by_name(session, name=group).id)
    if online is not None:
        query = query.where(Agent.online.is_(online))
    return session.scalars(query).all()


def running_sub_tasks(session: Session, *, agent: Agent) -> int:
    """Sub-tasks of the tasks' current attempts that `agent` has claimed and still runs."""
    return (
        session.scalar(
            select(func.count(SubTask.id))
            .join(Task, Task.id == SubTask.task_id)
            .where(*fate.running_on(agent.id))
        )
        or 0
    )


def update(session: Session, *, agent: Agent, data: AgentUpdate) -> Agent:
    """Change an agent's admin state or description.

    `draining` lets the agent finish the sub-tasks it runs while it claims no
    new ones and its workers leave the group's free capacity; `active` takes
    it back. A restarted agent keeps the state an admin gave it.

    Raises:
        Conflict: disabling an agent that still runs sub-tasks (drain it first).
    """
    changes = data.model_dump(exclude_unset=True, exclude_none=True)
    if changes.get("state") is AgentState.DISABLED:
        running = running_sub_tasks(session, agent=agent)
        if running:
            raise Conflict(
                f"agent '{agent.name}' still runs {running} sub-task(s); set state "
                f"'draining' first and disable it once they end",
                field="state",
            )
    for key, value in changes.items():
        setattr(agent, key, value)
    session.commit()
    return agent
