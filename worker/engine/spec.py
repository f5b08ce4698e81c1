"""The run specification: the one JSON payload every process of a task receives."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator


class GroupPlan(BaseModel):
    """One resource group's part in a task: its name, device type and number of workers."""

    name: str = Field(min_length=1)
    device_type: Literal["cpu", "cuda", "npu"]
    workers: int = Field(ge=1)


class RunSpec(BaseModel):
    """Everything a rank needs to take part in a task.

    Rank 0 is the parameter server; compute ranks start at 1 and each group in
    ``groups`` occupies a contiguous block of ranks, in list order. ``code`` is
    ``example:<name>`` (module ``examples/<name>.py`` of this repository) or an
    absolute path to a ``.py`` file. ``checkpoint_dir`` is written by the
    parameter server only; ``resume_from`` is a checkpoint path it can read.
    """

    task_id: int
    code: str = Field(min_length=1)
    epochs: int = Field(ge=1)
    global_batch_size: int = Field(ge=1)
    seed: int = Field(default=0, ge=0)
    groups: list[GroupPlan] = Field(min_length=1)
    split_policy: Literal["even"] = "even"
    checkpoint_dir: str
    resume_from: str | None = None

    @model_validator(mode="after")
    def _unique_group_names(self) -> RunSpec:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique, got {names}")
        return self

    @property
    def world_size(self) -> int:
        """Number of processes: the parameter server plus every compute worker."""
        return 1 + self.n_workers

    @property
    def n_workers(self) -> int:
        """Number of compute workers over all groups."""
        return sum(g.workers for g in self.groups)

    def group_index(self, g: int | str) -> int:
        """Index in ``groups`` of group ``g`` (an index or a name); raises KeyError if unknown."""
        if isinstance(g, int):
            if not 0 <= g < len(self.groups):
                raise KeyError(f"no group with index {g}")
            return g
        for i, plan in enumerate(self.groups):
            if plan.name == g:
                return i
        raise KeyError(f"no group named {g!r}")

    def group_ranks(self, g: int | str) -> list[int]:
        """Global ranks of group ``g`` (index or name), contiguous and ascending."""
        index = self.group_index(g)
        first = 1 + sum(p.workers for p in self.groups[:index])
        return list(range(first, first + self.groups[index].workers))

    def group_of(self, rank: int) -> int:
        """Index of the group that compute rank ``rank`` belongs to.

        Raises ValueError for rank 0 (the parameter server) or a rank outside the world.
        """
        if rank == 0:
            raise ValueError("rank 0 is the parameter server, not in any group")
        for i in range(len(self.groups)):
            if rank in self.group_ranks(i):
                return i
        raise ValueError(f"rank {rank} outside world of size {self.world_size}")

    def leader_ranks(self) -> list[int]:
        """First rank of every group, in group order."""
        return [self.group_ranks(i)[0] for i in range(len(self.groups))]
