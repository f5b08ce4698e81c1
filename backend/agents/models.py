"""Agents: processes serving one resource group's queue on one host."""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Enum, ForeignKey, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from backend.core.db import Base, utcnow
from backend.resource_groups.models import GroupState

# An agent's admin state means what a group's does: `draining` finishes what it runs and
# takes nothing new, `disabled` runs nothing (reachable once it runs nothing).
AgentState = GroupState


class Agent(Base):
    """One agent process serving one resource group's queue on one host.

    `online` follows heartbeats; `state` is set by admins. Only an online,
    active agent claims new sub-tasks and adds its workers to the group's
    free capacity. `instance_id` identifies the process family holding the
    name: the same agent restarted keeps it, a second agent has another.
    """

    __tablename__ = "agent"
    __table_args__ = (UniqueConstraint("name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    host: Mapped[str] = mapped_column(String(200))
    resource_group_id: Mapped[int] = mapped_column(
        ForeignKey("resource_group.id", ondelete="CASCADE"), index=True
    )
    workers: Mapped[int]
    hardware: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    online: Mapped[bool] = mapped_column(default=True)
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    state: Mapped[AgentState] = mapped_column(
        Enum(AgentState, native_enum=False, length=16, validate_strings=True, name="agentstate"),
        default=AgentState.ACTIVE,
        server_default="ACTIVE",
    )
    description: Mapped[str] = mapped_column(Text, default="", server_default="")
    # Who holds the name: the id an agent keeps in its data dir (worker/agent/identity.py).
    # A registration under a live agent's name with another id is refused.
    instance_id: Mapped[str | None] = mapped_column(String(64), default=None)


# The one filter for agents that offer workers: online (heartbeats arriving) and active (not
# drained or disabled by an admin). Capacity and the monitor's lost-work check both use it.
SERVING = Agent.online.is_(True) & (Agent.state == AgentState.ACTIVE)
