from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from backend.core.schemas import UtcDateTime
from backend.resource_groups.models import GroupState
from contracts.plan import DeviceType
from contracts.strict import StrictModel

NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
LABEL_KEY = r"^[a-zA-Z0-9][a-zA-Z0-9_.\-/]{0,62}$"
Labels = dict[str, str]


DeviceModel = Annotated[str, Field(min_length=1, max_length=200)]
ACCEPTED_MODELS_HELP = (
    "device models its agents may report (an agent of another model is refused); "
    "empty: the first agent's model is adopted"
)


def _labels_field() -> Labels:
    return Field(default_factory=dict, max_length=32, examples=[{"zone": "a", "model": "xeon"}])


class ResourceGroupCreate(StrictModel):
    name: str = Field(pattern=NAME_PATTERN, examples=["cpu-a"])
    device_type: DeviceType = Field(examples=["cpu"])
    description: str = Field(default="", max_length=2000)
    capacity: int = Field(ge=1, le=4096, description="most compute workers at once")
    labels: Labels = _labels_field()
    accepted_models: list[DeviceModel] = Field(
        default_factory=list, max_length=64, description=ACCEPTED_MODELS_HELP
    )


class ResourceGroupUpdate(StrictModel):
    """Fields to change; `state` drains (`draining`), disables or re-activates the group."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"state": "draining"},
                {"capacity": 4, "labels": {"zone": "a"}},
                {"accepted_models": ["NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB"]},
            ]
        }
    )

    device_type: DeviceType | None = None
    description: str | None = Field(default=None, max_length=2000)
    capacity: int | None = Field(default=None, ge=1, le=4096)
    labels: Labels | None = Field(default=None, max_length=32)
    accepted_models: list[DeviceModel] | None = Field(
        default=None,
        max_length=64,
        description=ACCEPTED_MODELS_HELP + "; a new device type without it empties it",
    )
    state: GroupState | None = None


class ResourceGroupRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    device_type: str
    description: str
    capacity: int
    labels: Labels
    accepted_models: list[str] = Field(default_factory=list, description=ACCEPTED_MODELS_HELP)
    state: GroupState
    created_at: UtcDateTime
    agents_online: int = 0
    online_workers: int = 0
    allocated_workers: int = 0
    free_workers: int = Field(default=0, description="workers a new task can get now")
    running_tasks: int = 0
