"""The compute-worker side: validation, per-worker reports, and the worker's entry.

The step loop itself belongs to the sync strategy
(:class:`worker.engine.strategy.Strategy`: ``strategy_sync``, ``strategy_periodic``,
``strategy_quorum``);
the session (:mod:`worker.engine.session`) runs epochs. Model buffers (e.g.
BatchNorm running statistics) travel with the parameters
(:mod:`worker.engine.state`), so validation in eval mode uses the global ones.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import Tensor

from worker.engine import report, session
from worker.engine.compute import validate
from worker.engine.contract import TrainingCode
from worker.engine.data import DataSources, StreamView
from worker.engine.distributed import Topology
from worker.engine.fsdp import return_freed_memory, shard_model
from worker.engine.run import Run
from worker.engine.spec import RunSpec


def report_worker_epoch(run: Run, results: dict[str, Any], seconds: float) -> None:
    """Per-worker metrics of one epoch: ``samples_per_s`` (samples over busy seconds: compute
    sections and the worker's own work between them, not its waits), ``batch_share`` and
    ``idle_fraction``.

    ``idle_fraction`` is the part of the epoch's step-loop seconds (``seconds``,
    validation excluded) this worker was not busy (:meth:`worker.engine.run.Run.compute`):
    waiting for slower workers and for communication at sync points and control points.
    In [0, 1]; near 0 means the worker never waited.
    """
    rank, work = run.topo.rank, run.epoch_work
    share = run.split.shares[run.topo.worker_index] / run.split.batch
    idle = min(1.0, max(0.0, 1.0 - work.compute_s / seconds)) if seconds > 0 else 0.0
    report.metric("samples_per_s", work.rate, step=run.step, epoch=run.epoch, rank=rank)
    report.metric("batch_share", share, step=run.step, epoch=run.epoch, rank=rank)
    report.metric("idle_fraction", idle, step=run.step, epoch=run.epoch, rank=rank)
    streamed = ""
    if isinstance(run.train, StreamView):
        stream = run.train.stream
        streamed = f"; {stream.replans} read plans, {stream.direct} batches read unplanned so far"
    report.log(
        f"rank {rank} epoch {run.epoch}: {work.samples} samples, {work.compute_s:.2f} s compute "
        f"of {seconds:.2f} s ({idle:.1%} idle), {work.rate:.1f} samples/s; next share "
        f"{share:.3f}{streamed}"
    )


def run_worker(
    spec: RunSpec,
    code: TrainingCode,
    topo: Topology,
    model: torch.nn.Module,
    data: DataSources,
    clock: report.StartupClock | None = None,
) -> Tensor:
    """Train as compute rank ``topo.rank`` until the last epoch; returns final parameters and
    buffers [P + B] for ``spec.debug_dump_dir``, else an empty tensor (a copy of the model
    at the end would only raise the rank's peak memory). ``clock``: the start-up's parts so
    far (:func:`worker.engine.session.start` adds its own and reports them).

    Raises whatever the user's code raises.
    """
    val_data = data.val
    assert val_data is not None
    model.to(topo.device)
    sharded = spec.sharded(topo.group_index)
    if sharded:
        # before the whole model built here is freed for its rows
        on = return_freed_memory()
        if topo.device.type == "cpu" and topo.am_i_leader:  # a CUDA unit's gathers: the device's
            report.log(allocator_note(spec.groups[spec.group_of(topo.rank)].name, on))
        shard_model(model, topo, spec.fsdp_units, spec.fsdp_param_dtype)
        session.release_freed_memory()  # the whole model's pages, freed for its rows
    strategy = session.strategy_for(spec.sync_strategy)
    own_optimizer = strategy.group_optimizers or strategy.replicated
    optimizer = code.build_optimizer(model.parameters()) if own_optimizer else None
    run, under_way = session.start(spec, code, topo, model, optimizer, data, None, clock)
    share = run.split.shares[topo.worker_index] / run.split.batch
    report.metric("batch_share", share, step=run.step, epoch=run.epoch, rank=topo.rank)
    val_batch = math.ceil(spec.global_batch_size / topo.n_workers)
    if (cap := spec.groups[spec.group_of(topo.rank)].max_local_batch) is not None:
        val_batch = min(val_batch, cap)
    session.train(
        run,
        under_way,
        # In batches of about the worker's share: a global batch per worker could overflow
        # the loader's shared memory where training never would. Within the group's
        # max_local_batch, where it has one (its workers' memory holds no more).
        lambda r: validate(
            code,
            topo,
            model,
            val_data,
            val_batch,
            r.split.shares,
            lockstep=sharded,
        ),
        report_worker_epoch,
    )
    if run.reducer is not None:
        run.reducer.close()
    if not spec.debug_dump_dir:  # only a debug dump reads it: gather or copy nothing
        return torch.empty(0)
    return run.state.vector().cpu()


def allocator_note(group: str, allocator: str) -> str:
    """The log line of a sharded CPU group's leader: which allocator its workers run on and
    what that means (worker/engine/ranks.py ``allocator_env``)."""
    if allocator == "jemalloc":
        return f"group {group}: its sharded workers run on jemalloc (POLYTRAIN_JEMALLOC)"
    if "jemalloc" in os.environ.get("LD_PRELOAD", ""):
        return (
            f"group {group}: jemalloc was asked for (POLYTRAIN_JEMALLOC) but did not load; "
            "its sharded workers run on glibc's malloc with a fixed mmap threshold"
        )
    return (
        f"group {group}: its sharded workers run on glibc's malloc with a fixed mmap "
        "threshold, the least memory: each step maps its unit gathers afresh. "
        "POLYTRAIN_JEMALLOC=on on the hosts (with libjemalloc2) runs them on jemalloc: about "
        "twice as fast at 10M parameters, 10-15 % more memory"
    )
