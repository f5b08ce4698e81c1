"""A compute worker's local work: one forward/backward, timed, and its throughput profile."""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from contracts.trial import PROFILE_WARM_UP, profile_stops
from worker.engine.contract import TrainingCode, default_metrics
from worker.engine.data import Source
from worker.engine.distributed import Topology
from worker.engine.emulation import SpeedEmulator
from worker.engine.exchange import params_of
from worker.engine.reducer import GradientReducer
from worker.engine.sharded import is_sharded
from worker.engine.sharding import contiguous_shard
from worker.engine.state import ModelState


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested tuple/list/dict) batch to ``device``."""
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


Observer = Callable[[Tensor, Tensor], None]
"""Takes a training step's ``(output, target)`` after the loss (detached, without grad): the
user's per-step ``metrics`` (:meth:`worker.engine.run.Run.compute`)."""


def batch_loss(
    code: TrainingCode,
    model: torch.nn.Module,
    data: Source,
    indices: Tensor,
    device: Any,
    observe: Observer | None = None,
) -> Tensor:
    """The user's ``loss_fn`` (a batch mean, scalar) on the items ``indices`` of ``data``;
    ``observe`` (when given) then sees the output and the target."""
    inputs, target = to_device(data.take(indices), device)
    output = model(inputs)
    loss = code.loss_fn(output, target)
    if observe is not None:
        with torch.no_grad():
            observe(output.detach(), target)
    return loss


def reduced_gradient(
    code: TrainingCode,
    model: torch.nn.Module,
    data: Source,
    indices: Tensor,
    device: Any,
    state: ModelState,
    base: list[Tensor],
    reducer: GradientReducer,
    observe: Observer | None = None,
) -> float:
    """:func:`local_gradient`'s vector, written into ``reducer`` as backward produces it.

    The forward pass, then the tail ``[buffer_change_sum (B), loss_sum, count]``
    (:meth:`GradientReducer.set_tail`), then backward, whose parameter hooks
    start the sum over the workers bucket by bucket; the caller collects it with
    :meth:`GradientReducer.finish`. A worker with no samples in the step only
    writes the zero tail. Returns this worker's loss sum.

    ``reducer`` holds the model's parameters (``model.parameters()``): their
    gradients are cleared through its list, and the tail is written in place
    into its vector, so a step allocates nothing here beyond the user's passes. ``observe``:
    :func:`batch_loss`'s.
    """
    for p in reducer.params:  # model.zero_grad(set_to_none=True), without the module walk
        p.grad = None
    count = len(indices)
    reducer.begin(count)
    loss, loss_sum = None, 0.0
    if count:
        loss = batch_loss(code, model, data, indices, device, observe)
        loss_sum = loss.item() * count
    tail = reducer.tail
    if state.buffers:
        tail[:-2].copy_(state.buffer_change(base, float(count), tail))
    tail[-2:].copy_(torch.tensor([loss_sum, float(count)], dtype=tail.dtype))
    reducer.set_tail()
    if loss is not None:
        loss.backward()
    return loss_sum


def sharded_gradient(
    code: TrainingCode,
    model: torch.nn.Module,
    data: Source,
    indices: Tensor,
    device: Any,
    state: ModelState,
    base: list[Tensor],
    observe: Observer | None = None,
) -> tuple[float, Tensor]:
    """Forward and backward of a sharded model (:mod:`worker.engine.fsdp`) on ``indices``:
    ``(loss_sum, tail)``, the tail ``[buffer_change_sum (B), loss_sum, count]`` of this
    worker alone, and each parameter's ``.grad`` this worker's rows of its group's sum of
    per-sample gradients (the loss is scaled by the count; the group's reduce-scatter sums).

    Every member of the group runs the unit gathers of forward and the reduce-scatters of
    backward together, so a sharded worker without samples in the step still runs both, on
    one item in eval mode (buffers unchanged), with the loss scaled by 0 (it adds nothing);
    a whole worker without samples computes nothing (its gradient counts as zeros).
    """
    for p in state.params:  # model.zero_grad(set_to_none=True), without the module walk
        p.grad = None
    count = len(indices)
    like = torch.zeros(0, dtype=state.params[0].dtype, device=device)
    loss_sum = 0.0
    if count:
        loss = batch_loss(code, model, data, indices, device, observe)
        loss_sum = loss.item() * count
        change = state.buffer_change(base, float(count), like)
        (loss * count).backward()
    else:
        change = like.new_zeros(state.n_buffers)
        if is_sharded(state.params[0]):  # its group's gathers need it: one item, adding 0
            model.eval()  # (BatchNorm takes one item in eval mode; the buffers stay)
            try:
                one = batch_loss(code, model, data, torch.zeros(1, dtype=torch.int64), device)
                (one * 0.0).backward()
            finally:
                model.train()
    tail = torch.tensor([loss_sum, float(count)], dtype=like.dtype, device=device)
    return loss_sum, torch.cat([change, tail])


def _forward_backward(
    code: TrainingCode, model: torch.nn.Module, data: Source, indices: Tensor, device: Any
) -> None:
    """The user's loss on ``indices`` and its backward, gradients left in the parameters."""
    model.zero_grad(set_to_none=True)
    batch_loss(code, model, data, indices, device).backward()


def local_gradient(
    code: TrainingCode,
    model: torch.nn.Module,
    data: Source,
    indices: Tensor,
    device: Any,
    state: ModelState | None = None,
    base: list[Tensor] | None = None,
    observe: Observer | None = None,
) -> Tensor:
    """Sum of per-sample gradients over ``indices``, then the buffers' change, then
    ``[loss_sum, count]``: shape [P + B + 2] (B = 0 without ``state``).

    ``loss_fn`` returns the batch mean, so gradient and loss are scaled by the
    local count ``b``; so is the change of ``state``'s buffers since ``base``
    (:meth:`worker.engine.state.ModelState.buffer_change`). With no samples
    the vector is all zeros. Each gradient is scaled straight into its slice of the one
    vector returned, so the step holds one [P] vector beside the gradients, not three.
    """
    params = params_of(model)
    model.zero_grad(set_to_none=True)
    count = len(indices)
    loss_sum = 0.0
    if count:
        loss = batch_loss(code, model, data, indices, device, observe)
        loss.backward()
        loss_sum = loss.item() * count
    n_params = sum(p.numel() for p in params)
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in params))  # as cat promotes
    like = torch.empty(0, dtype=dtype, device=params[0].device)
    change = (
        state.buffer_change(base, float(count), like)
        if state is not None and base is not None
        else like
    )
    out = like.new_empty(n_params + change.numel() + 2)
    offset = 0
    for p in params:
        part = out[offset : offset + p.numel()]
        if p.grad is None:
            part.zero_()
        else:  # the gradient in the vector's dtype, then scaled: as cat, then multiply, did
            part.copy_(p.grad.detach().reshape(-1)).mul_(count)
        offset += p.numel()
    out[offset : offset + change.numel()].copy_(change)
    out[-2:].copy_(torch.tensor([loss_sum, float(count)], dtype=out.dtype))
    return out


@dataclass
class Work:
    """Busy seconds (compute emulated, see :mod:`worker.engine.emulation`) and samples of a
    window, section by section."""

    compute_s: float = 0.0
    samples: int = 0
    sections: list[tuple[float, int, float]] = field(default_factory=list)
    own_s: float = 0.0  # of compute_s: the worker's own work between sections (its update)
    steps: int = 0  # the sections accounted, with samples or not
    opened: float = field(default_factory=time.perf_counter)  # when the window began
    closed: float | None = None  # when its last step ended, if before the check (epoch end)

    #: Fraction of a window's sections, the slowest per sample, that ``robust_seconds`` drops.
    TRIM = 0.1
    #: A section is *sustained* when the worker waited less than this fraction of its length
    #: just before it (it was the last to arrive at the previous sync point).
    SUSTAINED = 0.1

    def add(self, seconds: float, samples: int, waited: float = 0.0, own: float = 0.0) -> None:
        """Account one busy section; ``waited`` is the seconds this worker was idle, waiting
        for other ranks, just before it, and ``own`` the seconds of ``seconds`` that were its
        own work since the last section (its optimizer step, bookkeeping)."""
        self.compute_s += seconds
        self.samples += samples
        self.own_s += own
        self.steps += 1
        if seconds > 0 and samples > 0:
            self.sections.append((seconds, samples, waited))

    @property
    def robust_seconds(self) -> float:
        """Busy seconds for ``samples`` at the window's sustained rate, without its slowest
        sections.

        Sustained rate: when at least two sections of the window followed no wait
        (``waited`` under ``SUSTAINED`` of the section), only those give the rate.
        A device that runs faster for a while after idling (GPU and CPU boost
        clocks; a CFS-throttled process spending quota it did not use while it
        waited) looks faster in sections that follow a wait than it is once it
        is kept busy, which it is at the balanced split it would be given, so
        the rate it keeps without pauses is the one to balance on.

        Then an upper-trimmed mean: the slowest ``TRIM`` of the sections by time per
        sample (none in a window of fewer than 5, one in 5 to 10, two in 11 to
        20, ...) are dropped and the rest give the rate, seconds summed over
        samples summed. One step slowed by another process on the host is thus
        not chased, while a tail that recurs in every window, which lengthens
        the synchronous steps just as much, is counted; a median, which ignores
        any tail up to half the sections, let a worker with such a tail keep
        5-6 % too much work for good.
        """
        if not self.sections:
            return self.compute_s
        sustained = [s for s in self.sections if s[2] < self.SUSTAINED * s[0]]
        chosen = sustained if len(sustained) >= 2 else self.sections
        ordered = sorted(chosen, key=lambda section: section[0] / section[1])
        drop = math.ceil(self.TRIM * len(ordered)) if len(ordered) >= 5 else 0
        kept = ordered[: len(ordered) - drop]
        seconds = sum(t for t, _, _ in kept)
        return self.samples * seconds / sum(n for _, n, _ in kept)

    @property
    def rate(self) -> float:
        """Samples per second of busy time (0 when nothing was measured)."""
        return self.samples / self.compute_s if self.compute_s > 0 else 0.0


@dataclass
class BusyClock:
    """A worker's own work and its waits for other ranks between two compute sections.

    After a section the worker alternates between its own work (its optimizer
    step, reading the next batch, bookkeeping) and waits for other ranks (the
    sum, the averaged model, a control point's collective), each inside a
    ``with clock.waiting():`` block. :meth:`take`,
    just before the next section, gives the seconds of each since the last
    section. Before an epoch's first section the waited time is infinite: it
    follows the epoch's end (validation, checkpoint), the longest idle of all.
    """

    own_s: float = 0.0
    waited_s: float = math.inf
    working_since: float | None = None
    waiting_since: float | None = None

    def section_done(self) -> None:
        """A compute section just ended: own work starts again, nothing waited yet."""
        self.own_s, self.waited_s = 0.0, 0.0
        self.working_since, self.waiting_since = time.perf_counter(), None

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """The block is a wait for other ranks (a blocking exchange or collective); own work
        again after it."""
        now = time.perf_counter()
        if self.working_since is not None:
            self.own_s += now - self.working_since
        self.working_since, self.waiting_since = None, now
        try:
            yield
        finally:
            now = time.perf_counter()
            if self.waiting_since is not None and math.isfinite(self.waited_s):
                self.waited_s += now - self.waiting_since
            self.working_since, self.waiting_since = now, None

    def take(self) -> tuple[float, float]:
        """``(own seconds, waited seconds)`` since the last section, up to now."""
        own = self.own_s
        if self.working_since is not None:
            own += time.perf_counter() - self.working_since
        return own, self.waited_s


def profile_throughput(
    code: TrainingCode,
    model: torch.nn.Module,
    data: Source,
    batch_size: int,
    emulator: SpeedEmulator,
    *,
    steps: int,
    seed: int,
    pool: Tensor | None = None,
    budget_s: float | None = None,
) -> float:
    """Measured samples/s of forward/backward on ``batch_size`` training samples.

    One warm-up step on :data:`contracts.trial.PROFILE_WARM_UP` samples (what a first step
    pays once, the gradients' allocation and torch's lazy set-up, does not grow with the
    batch, and a slow worker's full-batch warm-up was most of its profile: 4 s at 25M
    parameters on a third of a core), then ``steps`` timed steps on seeded random samples
    of ``pool`` (int64 item indices; default every item), read as training reads them
    (planned ahead on the streaming path), or fewer once the timed steps' seconds reach
    ``budget_s`` (at least one; :func:`contracts.trial.profile_stops`): a slow worker's few
    long steps measure its
    rate as well as many short ones do, and every rank waits for the slowest profile. A
    sharded model ignores the budget: its group's members gather each unit together, so
    they take the same steps. The
    rate uses the median step time, so one step disturbed by another process
    does not skew it. The model's parameters, buffers (e.g. BatchNorm
    statistics) and torch's random state are left as they were. Returns 0.0
    for an empty batch.
    """
    pool = torch.arange(len(data)) if pool is None else pool
    if batch_size < 1 or len(pool) == 0:
        return 0.0
    # Forward and backward change no parameter, only buffers (e.g. BatchNorm statistics): a
    # copy of those, not of the whole model, restores it.
    saved = [b.detach().clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    generator = torch.Generator().manual_seed(seed)
    times = []
    device = next(model.parameters()).device
    batches = [
        pool[torch.randint(0, len(pool), (size,), generator=generator)]
        for size in [min(PROFILE_WARM_UP, batch_size)] + [batch_size] * steps
    ]
    data.plan(batches)
    # A sharded model's gradient stays in its rows (its group's members profile together).
    sharded = any(is_sharded(p) for p in model.parameters())
    step = _forward_backward if sharded else local_gradient
    for indices in batches:
        _, seconds = emulator.run(
            lambda idx=indices: step(code, model, data, idx, device),  # type: ignore[misc]
            len(indices),
        )
        times.append(seconds)
        if profile_stops(times[1:], steps, None if sharded else budget_s):
            break
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for buffer, before in zip(model.buffers(), saved, strict=True):
            buffer.copy_(before)
    torch.set_rng_state(rng)
    median = statistics.median(times[1:])
    return batch_size / median if median > 0 else 0.0


@torch.no_grad()
def validate(
    code: TrainingCode,
    topo: Topology,
    model: torch.nn.Module,
    data: Source,
    batch_size: int,
    shares: list[int] | None = None,
    lockstep: bool = False,
) -> dict[str, tuple[float, float]]:
    """This worker's share of validation: ``name -> (value * count, count)`` summed over batches.

    Names are ``val_loss`` and ``val_<key>`` for each key of the user's
    ``metrics`` (or :func:`default_metrics`), weighted by batch size. The worker's part
    is a contiguous block of the validation set (:func:`worker.engine.sharding.contiguous_shard`)
    in proportion to ``shares`` (the workers' batch shares, which follow their measured
    speed under the weighted split, so a slower worker validates fewer items and none
    waits long for another; even when None), read in batches of ``batch_size`` planned
    ahead; the sums over every worker are the sample-weighted means over the whole set.
    ``lockstep`` (a sharded group, whose every forward gathers each unit over the group):
    every member runs as many forwards as the member with the most batches, the extra ones
    on one item and not counted.
    """
    metrics_fn = code.metrics or default_metrics
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    weights = None if shares is None else [float(s) for s in shares]
    shard = contiguous_shard(len(data), topo.n_workers, topo.worker_index, weights)
    batches = [
        torch.arange(start, min(start + batch_size, shard.stop), dtype=torch.int64)
        for start in range(shard.start, shard.stop, batch_size)
    ]
    data.plan(batches)
    model.eval()
    extra = 0
    if lockstep:
        most = torch.tensor([len(batches)], device=topo.device)  # nccl on a CUDA group
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=topo.group)
        extra = int(most.item()) - len(batches)
    for _ in range(extra):
        inputs, _target = to_device(data.take(torch.zeros(1, dtype=torch.int64)), topo.device)
        model(inputs)
    for indices in batches:
        inputs, target = to_device(data.take(indices), topo.device)
        output = model(inputs)
        values = {"loss": float(code.loss_fn(output, target)), **metrics_fn(output, target)}
        for key, value in values.items():
            totals[f"val_{key}"][0] += float(value) * len(indices)
            totals[f"val_{key}"][1] += len(indices)
    model.train()
    return {k: (v[0], v[1]) for k, v in totals.items()}
