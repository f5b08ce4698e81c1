"""How a task's compute workers read their training data (`TaskCreate.data`), applied by the
training engine (:mod:`worker.engine.data`; docs/architecture.md, "Data path").

Every compute worker builds the user's map-style dataset itself and reads only the items
of its shard. ``path`` chooses how:

- ``streaming``: a ``torch.utils.data.DataLoader`` reads each step's items (the indices
  the split gives this worker) in ``num_workers`` loader processes, ``prefetch_factor``
  batches ahead, and applies the task's preprocessing per item there;
- ``memory``: the worker reads and preprocesses every item once at the start and keeps
  them stacked in memory (fastest for small in-memory datasets);
- ``auto`` (default): ``memory`` for a ``TensorDataset`` of at most
  :data:`MEMORY_PATH_MAX_BYTES`, ``streaming`` otherwise. The choice is logged.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DataPath = Literal["auto", "memory", "streaming"]

#: ``auto`` keeps a TensorDataset in memory up to this many bytes (training + validation).
MEMORY_PATH_MAX_BYTES = 256 * 2**20
#: Loader processes a rank may ask for (the engine also refuses more than the host's cores).
MAX_LOADER_WORKERS = 64


class DataOptions(BaseModel):
    """The data path and its DataLoader settings; unknown keys are refused by name."""

    model_config = ConfigDict(extra="forbid")

    path: DataPath = Field(
        default="auto",
        description="`streaming`: each worker reads its shard's items through a DataLoader; "
        "`memory`: each worker stacks the whole (small) set once; `auto`: memory for a "
        "TensorDataset up to 256 MiB, else streaming",
    )
    num_workers: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOADER_WORKERS,
        description="DataLoader processes per compute worker (streaming); default 0 for "
        "TensorDatasets without preprocessing (nothing to read ahead), else 1 on CPU and 2 on "
        "CUDA; at most the host's cores",
    )
    prefetch_factor: int = Field(
        default=2, ge=1, le=64, description="batches each loader process reads ahead"
    )
    persistent_workers: bool = Field(
        default=True, description="keep the loader processes between epochs"
    )
    pin_memory: bool | None = Field(
        default=None,
        description="page-locked batches for faster copies to a GPU (default: on CUDA)",
    )
