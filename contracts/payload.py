"""The JSON payload of one first-level dispatch message (one per resource group).

The backend builds it; the agent validates it again before acting on it. Its queue and
message name are in :mod:`contracts.messaging`.
"""

from typing import Any

from pydantic import BaseModel, Field, model_validator

from contracts.packages import Environment
from contracts.plan import GroupPlan, SplitPolicy, ps_ranks

DEFAULT_MAX_RUNTIME_S = 86_400
MAX_RUNTIME_S = 30 * 86_400  # the longest wall-clock limit a task may ask for
DEFAULT_MEMORY_LIMIT_MB = 4096


class TaskLimits(BaseModel):
    """What each rank of a task may use; the agent ends a rank beyond them (task FAILED).

    `max_runtime_s`: wall-clock seconds of each attempt, from its ranks' start
    on the agent. `memory_limit_mb`: data memory (heap and private writable
    mappings, RLIMIT_DATA) of each rank process in MiB, torch's own included.
    """

    max_runtime_s: int = Field(default=DEFAULT_MAX_RUNTIME_S, ge=1)
    memory_limit_mb: int = Field(default=DEFAULT_MEMORY_LIMIT_MB, ge=1)


class SubTaskPayload(BaseModel):
    """What an agent needs to run its part of a group's share of a task.

    Ranks: 0 is the parameter server; compute ranks start at 1 and each group
    holds a contiguous block, in the order of `groups`. A group spans agents:
    this part runs `part_workers` of its group's ranks from `first_rank` on
    (the whole group when they are None). `attempt` is the task's run
    (1 = first); a later attempt's parameter server resumes from checkpoint
    `resume_checkpoint_id`, fetched from the backend.
    """

    task_id: int
    sub_task_id: int
    attempt: int = Field(default=1, ge=1)
    resume_checkpoint_id: int | None = None
    group_index: int = Field(ge=0)
    part: int = Field(default=0, ge=0)
    agent_id: int | None = Field(
        default=None, description="the agent this part is booked for (the only one to claim it)"
    )
    first_rank: int | None = Field(default=None, ge=1)
    part_workers: int | None = Field(default=None, ge=1)
    hosts_parameter_server: bool
    epochs: int = Field(ge=1)
    global_batch_size: int = Field(ge=1)
    seed: int = 0
    split_policy: SplitPolicy = "even"
    groups: list[GroupPlan] = Field(min_length=1)
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="training-engine options (sync strategy, exchange, preprocessing, ...), "
        "validated by worker.engine.spec.RunSpec on the agent",
    )
    limits: TaskLimits = Field(default_factory=TaskLimits)
    environment: Environment | None = Field(
        default=None,
        description="the code version's own packages (its lock), built once per lock on each "
        "agent (worker.agent.environments); None: the platform's packages only",
    )

    @property
    def group(self) -> GroupPlan:
        """This sub-task's group: `groups[group_index]`."""
        return self.groups[self.group_index]

    @property
    def world_size(self) -> int:
        """Number of processes of the task: the parameter server, every compute worker and
        the parameter server's other shard owners (`engine["ps_shards"]` - 1)."""
        return sum(g.workers for g in self.groups) + int(self.engine.get("ps_shards", 1))

    @property
    def shard_ranks(self) -> list[int]:
        """The global ranks owning the parameter server's shards other than rank 0's, started
        by the part that hosts the parameter server (worker.engine.spec.RunSpec.shard_servers)."""
        workers = sum(g.workers for g in self.groups)
        return ps_ranks(workers, int(self.engine.get("ps_shards", 1)))[1:]

    @property
    def group_ranks(self) -> list[int]:
        """The global ranks of this group's compute workers, on every agent of its parts."""
        first = 1 + sum(g.workers for g in self.groups[: self.group_index])
        return list(range(first, first + self.group.workers))

    @property
    def ranks(self) -> list[int]:
        """The global ranks of this part's compute workers (the ones this agent starts)."""
        if self.first_rank is None or self.part_workers is None:
            return self.group_ranks
        return list(range(self.first_rank, self.first_rank + self.part_workers))

    @model_validator(mode="after")
    def _part_in_group(self) -> "SubTaskPayload":
        """A part's ranks are some of its group's (`first_rank` and `part_workers` together)."""
        if self.group_index >= len(self.groups):
            raise ValueError(f"group_index {self.group_index} names no group of {len(self.groups)}")
        if (self.first_rank is None) != (self.part_workers is None):
            raise ValueError("first_rank and part_workers come together")
        if not set(self.ranks) <= set(self.group_ranks):
            raise ValueError(f"ranks {self.ranks} are not in group {self.group_ranks}")
        return self
