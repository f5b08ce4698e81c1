"""How a task is laid out over resource groups: one group's part (`GroupPlan`), the device
types a group may have, how data and batch are split between its workers and how the groups
sync (the strategy names the API accepts; the engine has one class per name,
`worker.engine.strategy`)."""

from typing import Literal

from pydantic import BaseModel, Field

DeviceType = Literal["cpu", "cuda", "npu"]
SplitPolicy = Literal["even", "weighted"]
SyncStrategy = Literal["sync", "periodic", "quorum"]


class GroupPlan(BaseModel):
    """One resource group's part in a task.

    ``speed_factor`` (0 < f <= 1) is *emulation*: every compute section of the
    group's workers is padded with sleep so it takes ``1 / f`` times as long as
    this host takes undisturbed (see :mod:`worker.engine.emulation`). 1.0 means
    the hardware's own speed.
    """

    name: str = Field(min_length=1)
    device_type: DeviceType
    workers: int = Field(ge=1)
    speed_factor: float = Field(default=1.0, gt=0.0, le=1.0)
