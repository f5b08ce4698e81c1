from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DeviceType = Literal["cpu", "cuda", "npu"]
NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"


class ResourceGroupCreate(BaseModel):
    name: str = Field(pattern=NAME_PATTERN, examples=["cpu-a"])
    device_type: DeviceType = Field(examples=["cpu"])
    description: str = Field(default="", max_length=2000)
    capacity: int = Field(ge=1, le=4096, description="most compute workers at once")


class ResourceGroupUpdate(BaseModel):
    device_type: DeviceType | None = None
    description: str | None = Field(default=None, max_length=2000)
    capacity: int | None = Field(default=None, ge=1, le=4096)


class ResourceGroupRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    device_type: str
    description: str
    capacity: int
    created_at: datetime
    agents_online: int = 0
    online_workers: int = 0
    allocated_workers: int = 0
