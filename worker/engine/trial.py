"""A plan's trial run (``RunSpec.trial``): time the task's own step and exchanges, train nothing.

Every rank runs :func:`run_trial` instead of the training session (docs/architecture.md,
"Plans"). In order, the same on every rank:

1. each compute worker times its step, forward, backward and the optimizer step of the
   user's model, at each of the trial's local batch sizes (one warm-up step, then
   ``steps`` timed steps; their mean is kept: an epoch is a sum of steps, so its stalls
   count), on seeded random items of its even shard, with the peak memory of each size's
   steps (:mod:`worker.engine.memory`); after a validation pass, each worker of a group of
   two or more does the same with the model sharded over its group (FSDP2), the other
   choice of ``sharding`` a plan weighs;
2. each group of two or more workers times its in-group allreduce of a small vector and of
   the step's vector (the model's gradient and buffers, ``[P + B + 2]``);
3. the groups time the strategy's cross-group exchange at the same two sizes: for ``sync``
   the group leaders' allreduce, for ``periodic`` and ``quorum`` each leader's round trip
   to the parameter server, one leader at a time;
4. the parameter server gathers every timing (``distributed.gather_objects``), with each worker's
   optimizer construction and validation pass (over its even block of the validation set)
   and its own write of a checkpoint of the model and the user's optimizer, and reports
   them as a ``trial`` event (:class:`contracts.trial.TrialResult`) with the seconds from
   its process's creation to its data (``startup_s``); the backend fits the plan's
   performance model from them (``backend/plans/performance.py``).

The model is trained on trial batches and then dropped: nothing is checkpointed.
"""

from __future__ import annotations

import copy
import functools
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from contracts import sharded_state
from contracts.plan import SHARDED_STRATEGIES
from worker.engine import fsdp, memory, report
from worker.engine.compute import local_gradient, sharded_gradient, validate
from worker.engine.contract import TrainingCode
from worker.engine.data import DataSources, Source
from worker.engine.distributed import Topology, gather_objects, leader_ranks
from worker.engine.emulation import Pace, SpeedEmulator, synchronize
from worker.engine.exchange import params_of, vector_to_grads
from worker.engine.sharding import contiguous_shard
from worker.engine.spec import RunSpec
from worker.engine.state import ModelState

SMALL_NUMEL = 256  # the small vector of each exchange: its time is mostly latency


def _mean_s(action: Callable[[], Any], repeats: int) -> float:
    """Mean wall seconds of ``repeats`` calls of ``action`` after one warm-up call."""
    action()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.fmean(times)


class Timed(NamedTuple):
    """One worker's steps at each of the trial's batch sizes (same order): mean seconds,
    their standard deviation, and the peak memory in MiB (:func:`worker.engine.memory.peak_mib`;
    None where it cannot be read)."""

    step_s: list[float]
    step_sd: list[float]
    peak_mb: list[float] | None


def _batches(spec: RunSpec, topo: Topology, n_train: int) -> Callable[[int], list[torch.Tensor]]:
    """Seeded random batches of ``size`` items of this worker's even shard, one warm-up batch
    and the trial's ``steps`` (the same on every call with the same ``spec`` and rank)."""
    assert spec.trial is not None
    steps = spec.trial.steps
    shard = contiguous_shard(n_train, topo.n_workers, topo.worker_index)
    pool = torch.arange(shard.start, shard.stop) if len(shard) else torch.arange(n_train)
    generator = torch.Generator().manual_seed(spec.seed * 1000 + topo.rank)

    def draw(size: int) -> list[torch.Tensor]:
        return [
            pool[torch.randint(0, len(pool), (size,), generator=generator)]
            for _ in range(steps + 1)
        ]

    return draw


def _time_sizes(
    spec: RunSpec,
    topo: Topology,
    train: Source,
    n_train: int,
    step: Callable[[torch.Tensor, int], float],
) -> Timed:
    """``step(indices, size)`` (its seconds) timed at each batch size after a warm-up step,
    with the peak memory of each size's steps (the peak reset before each size)."""
    assert spec.trial is not None
    draw = _batches(spec, topo, n_train)
    means, spreads, peaks = [], [], []
    for size in spec.trial.batch_sizes:
        batches = draw(size)
        train.plan(batches)
        memory.reset_peak(topo.device)
        times = [step(indices, size) for indices in batches]
        means.append(statistics.fmean(times[1:]))
        spreads.append(statistics.pstdev(times[1:]))
        peaks.append(memory.peak_mib(topo.device))
    known = [p for p in peaks if p is not None]
    return Timed(means, spreads, known if len(known) == len(peaks) else None)


def time_steps(
    spec: RunSpec,
    code: TrainingCode,
    topo: Topology,
    model: torch.nn.Module,
    train: Source,
    n_train: int,
) -> tuple[Timed, float]:
    """Step 1: this worker's steps at each of the trial's batch sizes (:class:`Timed`: the
    spread, since a throttled or shared device's steps vary and every synchronous step waits
    for the slowest group's; the peak memory, for the plan's fit check), and the seconds
    building the user's optimizer took (a rank's own set-up before its first step: torch
    imports ``torch._dynamo`` at the first optimizer built, about 0.8 s of CPU).

    A step is what a worker does for one synchronous step apart from the exchange: the
    gradient of its local batch (emulated speed included, :class:`SpeedEmulator`), the
    gradient loaded into the parameters and one optimizer step."""
    emulator = _emulator(spec, topo)
    started = time.perf_counter()
    optimizer = code.build_optimizer(model.parameters())
    setup_s = time.perf_counter() - started
    params = params_of(model)
    n_params = sum(p.numel() for p in params)

    def step(indices: torch.Tensor, size: int) -> float:
        vector, compute_s = emulator.run(
            lambda: local_gradient(code, model, train, indices, topo.device), size
        )
        started = time.perf_counter()
        vector_to_grads(vector[:n_params] / size, params)
        optimizer.step()
        synchronize(topo.device)
        return compute_s + time.perf_counter() - started

    timed = _time_sizes(spec, topo, train, n_train, step)
    model.zero_grad(set_to_none=True)
    return timed, setup_s


def _emulator(spec: RunSpec, topo: Topology) -> SpeedEmulator:
    pace = Pace(spec.emulation_pace) if spec.emulation_pace else None
    return SpeedEmulator(spec.speed_factor_of(topo.rank), topo.device, pace)


def time_sharded_steps(
    spec: RunSpec,
    code: TrainingCode,
    topo: Topology,
    model: torch.nn.Module,
    train: Source,
    n_train: int,
) -> Timed | None:
    """The other sharding choice, on every worker of a group of two or more under a strategy
    that runs sharded groups (:data:`contracts.plan.SHARDED_STRATEGIES`; None elsewhere):
    the same steps with ``model`` sharded over the group (FSDP2, as a task with ``sharding:
    fsdp`` runs it, :mod:`worker.engine.fsdp`), timed and their peak memory measured. Every
    member of the group runs it alike (the unit gathers and reduce-scatters are collectives).
    ``model`` is sharded in place and is of no further use whole. A model that cannot be
    sharded (:class:`~worker.engine.fsdp.ShardingError`) gives None, logged."""
    if topo.group is None or len(topo.group_ranks) < 2:
        return None
    if spec.sync_strategy not in SHARDED_STRATEGIES or spec.diloco_exchange == "async":
        return None
    emulator = _emulator(spec, topo)
    fsdp.return_freed_memory()  # as a sharded worker runs (worker/engine/trainer.py)
    try:
        fsdp.shard_model(model, topo, spec.fsdp_units, spec.fsdp_param_dtype)
    except ValueError as exc:  # ShardingError, or a model FSDP2 refuses
        report.log(f"trial: rank {topo.rank} did not time the model sharded: {exc}")
        return None
    optimizer = code.build_optimizer(model.parameters())
    state = ModelState.of(model)
    width = len(topo.group_ranks)

    def step(indices: torch.Tensor, size: int) -> float:
        base = state.snapshot()
        _, compute_s = emulator.run(
            lambda: sharded_gradient(code, model, train, indices, topo.device, state, base),
            size,
        )
        started = time.perf_counter()
        for param in state.params:
            if param.grad is not None:
                param.grad.div_(size * width)
        optimizer.step()
        synchronize(topo.device)
        return compute_s + time.perf_counter() - started

    return _time_sizes(spec, topo, train, n_train, step)


def time_validation(
    code: TrainingCode, topo: Topology, model: torch.nn.Module, val: Source | None, batch: int
) -> float | None:
    """This worker's validation seconds per item: one pass over its even block of the
    validation set, as an epoch's end runs it (:func:`worker.engine.compute.validate`);
    None without a validation set or items."""
    if val is None or len(val) == 0:
        return None
    items = len(contiguous_shard(len(val), topo.n_workers, topo.worker_index))
    if items == 0:
        return None
    started = time.perf_counter()
    validate(code, topo, model, val, batch)
    synchronize(topo.device)
    return (time.perf_counter() - started) / items


def time_checkpoint(code: TrainingCode, model: torch.nn.Module, folder: str) -> float:
    """Seconds one checkpoint of the model and of the user's optimizer with its state takes
    to write (one update of zero gradients fills Adam's moments, so the files are as large as
    a real one's), into a temporary folder in ``folder``: as the engine writes it, the
    optimizer state with torch.distributed.checkpoint (its holder's, before the parameter
    server's file, contracts/sharded_state.py), then the file."""
    optimizer = code.build_optimizer(model.parameters())
    saved = copy.deepcopy(model.state_dict())
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    model.zero_grad(set_to_none=True)
    Path(folder).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        started = time.perf_counter()
        tensors = fsdp.state_tensors(optimizer.state_dict())
        with sharded_state.single_process():
            dcp.save(tensors, checkpoint_id=Path(tmp) / "trial.pt.dcp", no_dist=True)
        torch.save({"model": model.state_dict()}, Path(tmp) / "trial.pt")
        seconds = time.perf_counter() - started
    model.load_state_dict(saved)
    return seconds


def _allreduce(vector: torch.Tensor, group: dist.ProcessGroup | None) -> Callable[[], Any]:
    """One allreduce of ``vector``, waited for (a CUDA collective returns once queued)."""

    def action() -> None:
        dist.all_reduce(vector, group=group)
        synchronize(vector.device)

    return action


def _sizes(numel: int) -> list[int]:
    """The exchanged vector sizes in elements: a small one (at most a quarter of the step's
    vector), and the step's vector ``numel`` (at least 2)."""
    return [max(1, min(SMALL_NUMEL, numel // 4)), numel]


def time_group_allreduce(
    spec: RunSpec, topo: Topology, numel: int, dtype: torch.dtype
) -> dict[str, Any] | None:
    """Step 2, on every worker of a group of two or more (None elsewhere)."""
    assert spec.trial is not None
    if topo.group is None or len(topo.group_ranks) < 2:
        return None
    seconds, sizes = [], _sizes(numel)
    for size in sizes:
        vector = torch.zeros(size, dtype=dtype, device=topo.device)
        seconds.append(_mean_s(_allreduce(vector, topo.group), spec.trial.repeats))
    element = torch.empty(0, dtype=dtype).element_size()
    return {
        "kind": "group_allreduce",
        "group_index": topo.group_index,
        "members": len(topo.group_ranks),
        "bytes": [s * element for s in sizes],
        "seconds": seconds,
    }


def time_cross_exchange(
    spec: RunSpec, topo: Topology, numel: int, dtype: torch.dtype
) -> list[dict[str, Any]]:
    """Step 3: the cross-group exchange's timings, on the rank that reports them (the first
    leader for ``sync``, the parameter server otherwise); empty elsewhere. With one group,
    ``sync`` has no exchange (its leader has no one to allreduce with), but every other
    strategy still sends its model or update to the parameter server and back: that round
    trip is timed as with several groups."""
    assert spec.trial is not None
    repeats, sizes = spec.trial.repeats, _sizes(numel)
    element = torch.empty(0, dtype=dtype).element_size()
    if spec.sync_strategy == "sync":
        if len(spec.groups) < 2 or topo.cross is None:
            return []
        seconds = []
        for size in sizes:
            vector = torch.zeros(size, dtype=dtype)
            seconds.append(_mean_s(functools.partial(topo.cross.all_reduce, vector), repeats))
        if topo.rank != leader_ranks(topo)[0]:
            return []
        return [
            {
                "kind": "leaders_allreduce",
                "members": len(spec.groups),
                "bytes": [s * element for s in sizes],
                "seconds": seconds,
            }
        ]
    return _round_trips(topo, sizes, dtype, repeats, element)


def _round_trips(
    topo: Topology, sizes: list[int], dtype: torch.dtype, repeats: int, element: int
) -> list[dict[str, Any]]:
    """Each leader's round trip to the parameter server in turn, timed at the leader and
    sent to the server: a go token first, so a leader's clock starts when the server is
    ready for it and not while it serves an earlier group."""
    found = []
    for g, leader in enumerate(leader_ranks(topo)):
        if topo.rank not in (0, leader):
            continue
        peer = leader if topo.is_ps else 0
        seconds = []
        for size in sizes:
            vector = torch.zeros(size, dtype=dtype)
            token = torch.zeros(1)
            times = []
            for _ in range(repeats + 1):
                link = topo.link(peer)
                if topo.is_ps:
                    dist.send(token, dst=peer, group=link)
                    dist.recv(vector, src=peer, group=link)
                    dist.send(vector, dst=peer, group=link)
                else:
                    dist.recv(token, src=peer, group=link)
                    started = time.perf_counter()
                    dist.send(vector, dst=peer, group=link)
                    dist.recv(vector, src=peer, group=link)
                    times.append(time.perf_counter() - started)
            if not topo.is_ps:
                seconds.append(statistics.fmean(times[1:]))
        if not topo.is_ps:
            found.append(
                {
                    "kind": "ps_round_trip",
                    "group_index": g,
                    "members": 2,
                    "bytes": [s * element for s in sizes],
                    "seconds": seconds,
                }
            )
    return found


def run_trial(
    spec: RunSpec,
    code: TrainingCode,
    topo: Topology,
    model: torch.nn.Module,
    data: DataSources,
    clock: report.StartupClock,
) -> None:
    """Take part in the trial as rank ``topo.rank`` (steps 1-4 above). The start-up seconds
    reported are the parameter server's, from its process's creation (``clock``) to here:
    the interpreter and torch, the rendezvous with the last rank, the user's code, model
    and data. Workers also time their optimizer's construction and a validation pass, the
    parameter server a checkpoint (the parts of a task's time outside its steps that
    ``backend/plans/performance.py`` predicts).

    Raises whatever the user's code raises."""
    assert spec.trial is not None
    model.to(topo.device)
    state = ModelState.of(model)
    numel = state.n_params + state.n_buffers + 2
    dtype = params_of(model)[0].dtype
    del state  # it holds the whole parameters, which a sharded step frees
    startup_s = clock.elapsed()
    own = sum(seconds for part, seconds in clock.parts if part != "rendezvous")
    mine: dict[str, Any] = {"exchanges": []}
    startup_peak_mb = memory.peak_mib(topo.device)  # the whole model built, the data read
    if not topo.is_ps:
        assert data.train is not None
        whole, setup_s = time_steps(spec, code, topo, model, data.train, data.n_train)
        batch = math.ceil(spec.global_batch_size / topo.n_workers)
        val_s_per_item = time_validation(code, topo, model, data.val, batch)
        sharded = time_sharded_steps(spec, code, topo, model, data.train, data.n_train)
        mine["worker"] = {
            "rank": topo.rank,
            "group_index": topo.group_index,
            "batch_sizes": list(spec.trial.batch_sizes),
            "step_s": whole.step_s,
            "step_sd": whole.step_sd,
            "startup_s": own,
            "setup_s": setup_s,
            "val_s_per_item": val_s_per_item,
            "startup_peak_mb": startup_peak_mb,
            "peak_mb": whole.peak_mb,
            "sharded_step_s": sharded.step_s if sharded else None,
            "sharded_peak_mb": sharded.peak_mb if sharded else None,
        }
        in_group = time_group_allreduce(spec, topo, numel, dtype)
        if in_group is not None and topo.am_i_leader:
            mine["exchanges"].append(in_group)
    mine["exchanges"] += time_cross_exchange(spec, topo, numel, dtype)
    gathered = gather_objects(mine, topo)
    if gathered is None:
        return
    workers = [part["worker"] for part in gathered if "worker" in part]
    exchanges = [e for part in gathered for e in part["exchanges"]]
    element = torch.empty(0, dtype=dtype).element_size()
    checkpoint_s = time_checkpoint(code, model, spec.checkpoint_dir)
    report.trial(
        {
            "n_train": data.n_train,
            "n_val": data.n_val,
            "exchange_bytes": numel * element,
            "startup_s": startup_s,
            "ps_startup_s": own,
            "checkpoint_s": checkpoint_s,
            # its whole life's peak: the model, and a checkpoint's optimizer state
            "ps_peak_mb": memory.peak_mib(torch.device("cpu")),
            "workers": workers,
            "exchanges": exchanges,
        }
    )
    report.log(
        f"trial: {len(workers)} workers timed at local batch sizes {spec.trial.batch_sizes}, "
        f"{len(exchanges)} exchanges timed"
    )
    report.done()
