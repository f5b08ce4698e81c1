from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class AgentRegister(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    host: str = Field(min_length=1, max_length=200)
    resource_group: str
    workers: int = Field(ge=1, le=1024)
    hardware: dict[str, Any] = Field(default_factory=dict)


class AgentRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    host: str
    resource_group_id: int
    workers: int
    hardware: dict[str, Any]
    online: bool
    registered_at: datetime
    last_heartbeat_at: datetime
