"""The internal API's bodies: what an agent sends about its sub-tasks (claim, rendezvous,
a report of logs, metrics and progress, checkpoints, finished, heartbeat with the ranks'
resource use) and what the backend answers (a heartbeat: its tasks' states).

Request bodies derive from `StrictModel` (unknown fields and NUL characters refused by name).
"""

import math
import re
from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from contracts.plan import DeviceType
from contracts.strict import StrictModel

CHECKPOINT_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}$"
CHECKPOINT_NAME = re.compile(CHECKPOINT_NAME_PATTERN)
"""A checkpoint's file name: one visible name (not `.`, `..` or `.x`), no folders."""

ACTIVE_STATUSES = frozenset({"SCHEDULED", "RUNNING"})
"""The task statuses (`TaskState.status`) in which the agents run the task's current attempt;
the backend's `ACTIVE` set is built from these names, and an agent stops its ranks in any
other status."""


class Hardware(StrictModel):
    """What an agent detected on its host for the device type of the group it serves
    (docs/architecture.md, "Homogeneous groups").

    `device_type` and `device_model` are what the group is checked against: the CPU model
    name for a `cpu` group, the GPU's (`torch.cuda.get_device_name`) for `cuda`, the NPU's
    for `npu`. `device_memory_mb` is that device's memory (host RAM for `cpu`). An agent
    that reports no device (an older one) counts as a `cpu` agent of model `unknown`.
    The rest is informative: cores, host RAM (bytes), every CUDA device's name, the OS
    platform string and the torch version.
    """

    device_type: DeviceType = "cpu"
    device_model: str = Field(
        default="unknown", min_length=1, max_length=200, examples=["NVIDIA A100-SXM4-40GB"]
    )
    device_memory_mb: int = Field(default=0, ge=0)
    cpu_cores: int = Field(ge=1, le=100_000)
    memory_bytes: int = Field(ge=0)
    cuda_devices: list[str] = Field(default_factory=list, max_length=1024)
    platform: str = Field(default="", max_length=500, examples=["Linux-6.1.0-x86_64"])
    torch: str = Field(default="", max_length=100, examples=["2.13.0+cpu"])


class GroupDevice(BaseModel):
    """What an agent learns of its group before registering: the device type it must serve
    it with, and the device models it accepts (empty: the first agent's model is adopted)."""

    name: str
    device_type: DeviceType
    accepted_models: list[str] = []


class Claim(StrictModel):
    """An agent takes its part. `preparing`: it first builds the code version's environment,
    so the task is not counted as started until it reports the part ready. `claim_id`: made
    by the agent for this claim (a random token, the same in every retry of the request): a
    retry of a claim the API took, whose answer was lost (the API process killed, a dropped
    connection), is answered as the first was, where a redelivered message (a new claim) is
    refused."""

    agent_id: int
    host: str
    attempt: int = Field(default=1, ge=1)
    preparing: bool = False
    claim_id: str | None = Field(default=None, min_length=16, max_length=64)


class Ready(StrictModel):
    """A preparing part is ready to start its ranks (`detail`: what the preparation took)."""

    detail: str = Field(default="", max_length=2000)


class Rendezvous(StrictModel):
    master_addr: str = Field(min_length=1, max_length=200)
    master_port: int = Field(ge=1, le=65535)
    attempt: int = Field(default=1, ge=1)


class RendezvousRead(BaseModel):
    """Where the task's current attempt meets: the parameter server's store, and the hosts its
    ranks run on (`peer_hosts`, as their agents claimed them; `peers_complete` once every
    sub-task of the attempt is claimed), which the agents let their ranks reach."""

    master_addr: str | None
    master_port: int | None
    status: str
    attempt: int = 1
    peer_hosts: list[str] = []
    peers_complete: bool = False


class LogIn(StrictModel):
    attempt: int = Field(default=1, ge=1)
    node: str = Field(max_length=64)
    seq: int = Field(ge=0)
    time: datetime
    text: str


class LogBatch(StrictModel):
    lines: list[LogIn] = Field(max_length=10_000)


NonFinite = Literal["nan", "inf", "-inf"]


class MetricIn(StrictModel):
    """One metric value; a NaN or infinite one comes as ``value`` null plus ``nonfinite``
    (a float NaN/inf, where a JSON parser lets one through, is turned into that form).

    ``attempt``, ``node`` and ``seq`` (all three or none): the value's place in its node's
    sequence of metrics in that attempt, counted from 0 by the agent's reporter, so a report
    sent again after its answer was lost stores each value once, as its log lines are
    (`reports.add_report`). A value without them (an agent of an older release) is stored
    as it comes."""

    name: str = Field(max_length=100)
    value: float | None
    nonfinite: NonFinite | None = None
    step: int = 0
    epoch: int = 0
    rank: int | None = None
    attempt: int | None = Field(default=None, ge=1, le=2**31 - 1)
    node: str | None = Field(default=None, max_length=64)
    seq: int | None = Field(default=None, ge=0, le=2**31 - 1)

    @model_validator(mode="after")
    def _numbered_whole(self) -> "MetricIn":
        if len({self.attempt is None, self.node is None, self.seq is None}) > 1:
            raise ValueError("seq: give attempt, node and seq together, or none of them")
        return self

    @model_validator(mode="after")
    def _one_value(self) -> "MetricIn":
        if self.value is not None and not math.isfinite(self.value):
            self.nonfinite = (
                "nan" if math.isnan(self.value) else ("inf" if self.value > 0 else "-inf")
            )
            self.value = None
        if (self.value is None) == (self.nonfinite is None):
            raise ValueError(
                "value: give a finite number, or null with nonfinite 'nan', 'inf' or '-inf'"
            )
        return self


class MetricBatch(StrictModel):
    metrics: list[MetricIn] = Field(max_length=10_000)


HASH_PATTERN = r"^[0-9a-f]{16}$"
INT32_MAX = 2**31 - 1
"""The largest value an INTEGER column holds (PostgreSQL): a larger one is refused as input."""
DbId = Annotated[int, Field(ge=1, le=INT32_MAX)]
"""A row's id as the database holds it (an INTEGER key): a heartbeat's ids are held and
written a second later (`backend.agents.stamps`), so one no column can hold is refused here,
where the agent hears of it, not at the write."""


class ShardRecordIn(StrictModel):
    """The samples one compute worker took between two checkpoints of one epoch, as the
    parameter server recorded them (``worker.engine.provenance``): how many, an additive
    multiset hash of their indices, and how many a rebalance or the neighbour exchange
    moved to it."""

    worker: int = Field(ge=0, le=100_000)
    rank: int = Field(ge=1, le=100_001)
    group_index: int = Field(ge=0, le=100_000)
    group: str = Field(max_length=100)
    epoch: int = Field(ge=0, le=INT32_MAX)
    step_from: int = Field(ge=0, le=INT32_MAX)
    step_to: int = Field(ge=0, le=INT32_MAX)
    samples: int = Field(ge=0, le=INT32_MAX)
    index_hash: str = Field(pattern=HASH_PATTERN)
    rebalanced: int = Field(ge=0, le=INT32_MAX)
    exchanged: int = Field(ge=0, le=INT32_MAX)

    @model_validator(mode="after")
    def _consistent(self) -> "ShardRecordIn":
        if self.step_to < self.step_from:
            raise ValueError("step_to: must not be before step_from")
        if max(self.rebalanced, self.exchanged) > self.samples:
            raise ValueError("rebalanced, exchanged: cannot exceed samples")
        return self


class Provenance(StrictModel):
    """The shard provenance a checkpoint carries: the segments since the previous one, with
    the training set's size and the hash of the whole set to check an epoch against."""

    n_items: int = Field(ge=0, le=INT32_MAX)
    set_hash: str = Field(pattern=HASH_PATTERN)
    records: list[ShardRecordIn] = Field(max_length=100_000)


class Alarm(StrictModel):
    """An alarm a task's parameter server raised about one of its groups (e.g. numbers that
    disagree with its own, ``worker.engine.agreement``); becomes an alarm event of the task.
    ``kind`` ``guard``: not a fault but the guard parking a group or taking it back
    (``worker.engine.guard``); becomes a guard event."""

    reason: str = Field(min_length=1, max_length=2000)
    group: str = Field(max_length=100)
    attempt: int = Field(default=1, ge=1)
    kind: Literal["alarm", "guard"] = "alarm"


class Progress(StrictModel):
    progress: float = Field(ge=0.0, le=1.0)
    epoch: int = Field(ge=0)
    attempt: int | None = Field(
        default=None, ge=1, description="the attempt reporting; an earlier attempt's is ignored"
    )


class Finished(StrictModel):
    """A group's outcome. `cause` of a failure: `user` (the training code raised: final),
    `infra` (a process killed by a signal, or the agent failed: restart), `peer` (only
    errors from a peer that went away: wait for the root cause), `stopped` (by the agent)."""

    succeeded: bool
    detail: str = ""
    cause: Literal["user", "infra", "peer", "stopped"] = "user"


class TaskState(BaseModel):
    status: str
    attempt: int = 1


class TaskStateOf(TaskState):
    """A task's status and current attempt, named."""

    task_id: int


STATE_WAIT_S = 25.0
"""How long an agent's long-poll of a task's state (`GET /tasks/{id}/state?status=&attempt=
&wait_s=`) waits for a change before it is answered with the state unchanged."""
STATE_WAIT_MAX_S = 30.0


REPORT_MAX_ITEMS = 10_000
"""The most log lines, and the most metrics, one report carries: a reporter holding more
sends them in several reports, in order."""


class Report(StrictModel):
    """What a sub-task's reporter sends in one request (`POST /tasks/{id}/report`): its log
    lines, metrics and latest progress, stored in one transaction."""

    lines: list[LogIn] = Field(default_factory=list, max_length=REPORT_MAX_ITEMS)
    metrics: list[MetricIn] = Field(default_factory=list, max_length=REPORT_MAX_ITEMS)
    progress: Progress | None = None


class HeartbeatReply(BaseModel):
    """The answer to a heartbeat: the state of every task the agent named (in `running` or
    `tasks`), so an agent learns of a cancellation or a restart at least every beat."""

    tasks: list[TaskStateOf] = []


RESOURCE_SAMPLE_EVERY_S = 15.0
"""Seconds between two resource samples of a rank (`RankSample`; an agent sends at most one
per heartbeat): a task that ends sooner has one sample per rank or none, so the task page
says so instead of drawing empty CPU and memory charts."""


class RankSample(StrictModel):
    """One rank's resource use, summed over its process tree: CPU in percent of one core
    (over the time since the previous sample), resident memory (RSS) in MiB and, on a GPU
    host, the utilization (percent) and memory (MiB) of the GPUs its processes use."""

    rank: int = Field(ge=0, le=INT32_MAX)
    cpu_percent: float = Field(ge=0, allow_inf_nan=False)
    rss_mb: float = Field(ge=0, allow_inf_nan=False)
    gpu_util: float | None = Field(default=None, ge=0, le=100)
    gpu_mem_mb: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class RunningRanks(StrictModel):
    """A task's ranks alive on the agent and, every few heartbeats, their resource use
    (`samples`; an agent that does not measure it sends none)."""

    task_id: DbId
    ranks: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(max_length=4096)
    samples: list[RankSample] = Field(default_factory=list, max_length=4096)


class Heartbeat(StrictModel):
    """An agent's heartbeat, with the ranks whose processes are alive on it, and the tasks it
    runs a part of (`tasks`, also those whose ranks have not started yet): the answer
    (`HeartbeatReply`) gives the state of each task named in either."""

    running: list[RunningRanks] = Field(default_factory=list, max_length=1024)
    tasks: list[DbId] = Field(default_factory=list, max_length=1024)
