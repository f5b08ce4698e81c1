from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from backend.tasks.models import NodeRole, SubTaskStatus, TaskStatus


class GroupRequest(BaseModel):
    """Workers asked of one resource group."""

    name: str = Field(min_length=1, max_length=64, examples=["cpu-a"])
    workers: int = Field(ge=1, le=1024, examples=[2])


class TaskCreate(BaseModel):
    """A training task: one code version, trained across the listed resource groups."""

    project_id: int
    code_version_id: int
    name: str = Field(default="", max_length=200)
    resource_groups: list[GroupRequest] = Field(min_length=1, max_length=16)
    epochs: int = Field(default=5, ge=1, le=10_000)
    global_batch_size: int = Field(default=64, ge=1, le=1_000_000,
                                   description="samples per optimizer step across all workers")
    split_policy: Literal["even"] = "even"
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    priority: int = Field(default=0, ge=-100, le=100)

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "project_id": 1, "code_version_id": 1, "name": "mnist across two groups",
        "resource_groups": [{"name": "cpu-a", "workers": 2}, {"name": "cpu-b", "workers": 1}],
        "epochs": 5, "global_batch_size": 64,
    }]})

    @model_validator(mode="after")
    def _check(self) -> "TaskCreate":
        names = [g.name for g in self.resource_groups]
        if len(set(names)) != len(names):
            raise ValueError("resource_groups lists a group twice")
        workers = sum(g.workers for g in self.resource_groups)
        if self.global_batch_size < workers:
            raise ValueError(f"global_batch_size ({self.global_batch_size}) is smaller than the "
                             f"number of workers ({workers})")
        return self


class TaskRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    project_id: int
    code_version_id: int
    name: str
    status: TaskStatus
    status_reason: str
    priority: int
    spec: dict
    progress: float
    epoch: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class TaskEventRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    from_status: TaskStatus | None
    to_status: TaskStatus
    reason: str
    created_at: datetime


class AllocationRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    role: NodeRole
    resource_group: str
    rank: int | None
    host: str | None
    last_heartbeat_at: datetime | None
    created_at: datetime
    released_at: datetime | None


class SubTaskRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    resource_group: str
    group_index: int
    workers: int
    hosts_parameter_server: bool
    status: SubTaskStatus
    detail: str


class LogLineRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    node: str
    seq: int
    time: datetime
    text: str


class MetricRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    step: int
    epoch: int
    name: str
    value: float
    rank: int | None


class CheckpointRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    epoch: int
    step: int
    size_bytes: int
    created_at: datetime
