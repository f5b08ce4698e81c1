"""A plan's trial run: what the engine is asked to time (`TrialOptions`, the task spec's
engine option `trial`) and what its parameter server reports back (`TrialResult`, the body
of `PUT /internal/v1/tasks/{id}/trial`).

A trial is a short real task on the candidate groups (docs/architecture.md, "Plans"): every
compute worker times its training step (forward, backward and optimizer step of the task's
own model) at each of `batch_sizes` local samples; every group of two or more workers times
its in-group allreduce, and the groups together time the strategy's cross-group exchange, at
two sizes (a small vector and the model's), so latency and bandwidth can be told apart.
"""

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from contracts.strict import StrictModel

INT32_MAX = 2**31 - 1
PROFILE_STEPS = 5
"""Timed steps of each throughput profile at a task's start (after one warm-up step): the
engine's default `profile_steps`, and what a plan predicts the profile to cost."""
PROFILE_BUDGET_S = 2.0
"""Seconds of timed steps after which a worker's profile stops early (the engine's default
`profile_budget_s`): a slow worker's rate is read from fewer, longer steps, instead of every
other rank waiting for its `PROFILE_STEPS` (a third of a core at 25M parameters: 4 s a step,
24 s a profile)."""


PROFILE_WARM_UP = 2
"""Samples of a throughput profile's warm-up step (worker/engine/compute.py,
``profile_throughput``; BatchNorm in training refuses one), which a plan prices."""


def profile_stops(timed_s: Sequence[float], steps: int, budget_s: float | None) -> bool:
    """Whether a throughput profile stops after the timed steps that took ``timed_s``
    seconds: all ``steps`` taken, or at least one and their seconds reaching ``budget_s``
    (None: no budget). The engine's rule (worker/engine/compute.py,
    ``profile_throughput``)."""
    if len(timed_s) >= steps:
        return True
    return budget_s is not None and len(timed_s) > 0 and sum(timed_s) >= budget_s


def profile_timed_steps(step_s: float, steps: int, budget_s: float | None) -> int:
    """The timed steps a throughput profile takes at ``step_s`` seconds a step
    (:func:`profile_stops`): ``steps``, or fewer once their seconds reach ``budget_s``,
    never fewer than one; what a plan prices."""
    taken = 1
    while not profile_stops([step_s] * taken, steps, budget_s):
        taken += 1
    return taken


ExchangeKind = Literal["group_allreduce", "leaders_allreduce", "ps_round_trip"]
"""`group_allreduce`: one group's workers allreduce (gloo/nccl ring) a vector;
`leaders_allreduce`: the group leaders allreduce it (the cross-group sum of `sync`);
`ps_round_trip`: one group leader sends it to the parameter server and gets it back (the
model exchange of `periodic` and `quorum`)."""


BatchSize = Annotated[int, Field(ge=1, le=10_000_000)]
Bytes = Annotated[int, Field(ge=1, le=2**40)]


class TrialOptions(BaseModel):
    """What a trial task times. `batch_sizes`: local batch sizes (samples per worker) each
    worker times, two or more, distinct; `steps`: timed steps at each size after one
    warm-up step (their mean is kept: an epoch is a sum of steps); `repeats`: timed
    repetitions of each exchange (mean)."""

    batch_sizes: list[BatchSize] = Field(min_length=2, max_length=8)
    steps: int = Field(default=5, ge=1, le=100)
    repeats: int = Field(default=5, ge=1, le=100)

    @model_validator(mode="after")
    def _distinct(self) -> "TrialOptions":
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError("batch_sizes: every size must be at least 1")
        if len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise ValueError("batch_sizes: sizes must be distinct")
        return self


class WorkerTiming(StrictModel):
    """One compute worker's mean step seconds at each local batch size (same order) and
    their standard deviation (`step_sd`); the seconds from its process's creation to its
    data, less the rendezvous's wait for other ranks (`startup_s`: its own start-up); the
    seconds it took to build the user's optimizer (`setup_s`, the rank's own preparation
    before its first step); its validation seconds per item over its even block of the
    validation set (`val_s_per_item`). The last four are None in a trial from before they
    were timed.

    Memory, in MiB, the peak of what bounds the worker at each batch size (same order): its
    device's memory on CUDA, its data memory on CPU (what ``memory_limit_mb`` caps;
    worker/engine/memory.py): `peak_mb` with the whole model; for a worker of a group of two
    or more, `sharded_step_s` and `sharded_peak_mb` with the model sharded over its group
    (FSDP2, worker/engine/fsdp.py); `startup_peak_mb`, the peak before the first step (the
    model built whole and the data read, which a sharded worker also goes through). None
    where not measured (an older trial, a model that cannot be sharded, no /proc)."""

    rank: int = Field(ge=1, le=100_001)
    group_index: int = Field(ge=0, le=100_000)
    batch_sizes: list[BatchSize] = Field(min_length=2, max_length=8)
    step_s: list[float] = Field(min_length=2, max_length=8)
    step_sd: list[float] | None = Field(default=None, min_length=2, max_length=8)
    startup_s: float | None = Field(default=None, ge=0.0, le=1e6)
    setup_s: float | None = Field(default=None, ge=0.0, le=1e6)
    val_s_per_item: float | None = Field(default=None, ge=0.0, le=1e6)
    startup_peak_mb: float | None = Field(default=None, gt=0.0, lt=1e9)
    peak_mb: list[float] | None = Field(default=None, min_length=2, max_length=8)
    sharded_step_s: list[float] | None = Field(default=None, min_length=2, max_length=8)
    sharded_peak_mb: list[float] | None = Field(default=None, min_length=2, max_length=8)

    @model_validator(mode="after")
    def _paired(self) -> "WorkerTiming":
        if len(self.batch_sizes) != len(self.step_s):
            raise ValueError("step_s: one value per batch size")
        for name in ("peak_mb", "sharded_step_s", "sharded_peak_mb"):
            values = getattr(self, name)
            if values is not None and (
                len(values) != len(self.batch_sizes) or any(not 0 < v < 1e9 for v in values)
            ):
                raise ValueError(f"{name}: one positive, finite value per batch size")
        if self.step_sd is not None and (
            len(self.step_sd) != len(self.step_s) or any(not 0 <= s < 1e6 for s in self.step_sd)
        ):
            raise ValueError("step_sd: one non-negative, finite value per batch size")
        if any(not 0 < s < 1e6 for s in self.step_s):
            raise ValueError("step_s: seconds must be positive and finite")
        return self


class ExchangeTiming(StrictModel):
    """Mean seconds of one exchange (`kind`) among `members` processes at each size in
    `bytes`; `group_index` names the group (None for `leaders_allreduce`)."""

    kind: ExchangeKind
    group_index: int | None = Field(default=None, ge=0, le=100_000)
    members: int = Field(ge=2, le=100_001)
    bytes: list[Bytes] = Field(min_length=2, max_length=8)
    seconds: list[float] = Field(min_length=2, max_length=8)

    @model_validator(mode="after")
    def _paired(self) -> "ExchangeTiming":
        if len(self.bytes) != len(self.seconds):
            raise ValueError("seconds: one value per size in bytes")
        if any(not 0 <= s < 1e6 for s in self.seconds):
            raise ValueError("seconds: must be non-negative and finite")
        return self


class TrialResult(StrictModel):
    """What the parameter server reports at the end of a trial: the training and validation
    sets' sizes, the bytes one step exchanges (the model's gradient and buffers vector), the
    seconds from its process's creation to the first timed step (`startup_s`: interpreter,
    torch, rendezvous with the last rank, the user's code, model and data), its own part of
    them (`ps_startup_s`: without the rendezvous's wait), the seconds one
    checkpoint of the model and the user's optimizer takes to write (`checkpoint_s`, None
    in a trial from before it was timed), its own peak memory over the trial in MiB
    (`ps_peak_mb`: the whole model, and a checkpoint's optimizer state; None where not
    measured), and every timing."""

    n_train: int = Field(ge=1, le=INT32_MAX)
    n_val: int = Field(default=0, ge=0, le=INT32_MAX)
    exchange_bytes: int = Field(ge=1, le=2**40)
    startup_s: float = Field(ge=0.0, le=1e6)
    ps_startup_s: float | None = Field(default=None, ge=0.0, le=1e6)
    checkpoint_s: float | None = Field(default=None, ge=0.0, le=1e6)
    ps_peak_mb: float | None = Field(default=None, gt=0.0, lt=1e9)
    workers: list[WorkerTiming] = Field(min_length=1, max_length=10_000)
    exchanges: list[ExchangeTiming] = Field(default_factory=list, max_length=10_000)
