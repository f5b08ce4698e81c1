from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from backend.agents.models import AgentState
from backend.core.schemas import UtcDateTime
from contracts.agent_api import Hardware
from contracts.strict import StrictModel


class AgentRegister(StrictModel):
    """An agent announcing itself; `instance_id` is the identity it keeps in its data dir.

    A live agent (online, heartbeat within the timeout) keeps its name: a
    registration under that name with another (or no) `instance_id` is refused.
    """

    name: str = Field(min_length=1, max_length=200)
    instance_id: str | None = Field(
        default=None, min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_-]+$"
    )
    host: str = Field(min_length=1, max_length=200)
    resource_group: str
    workers: int = Field(ge=1, le=1024)
    hardware: Hardware


class AgentRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    host: str
    resource_group_id: int
    workers: int
    hardware: dict[str, Any]
    online: bool
    registered_at: UtcDateTime
    last_heartbeat_at: UtcDateTime
    state: AgentState = Field(description="admin state: active, draining or disabled")
    description: str = ""


class AgentUpdate(StrictModel):
    """Fields an admin changes; `state` drains (`draining`), disables or re-activates it."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"state": "draining"}, {"description": "rack 3, replace fan"}]
        }
    )

    state: AgentState | None = None
    description: str | None = Field(default=None, max_length=2000)
