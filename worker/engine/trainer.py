"""The compute-worker loop: local forward/backward, hierarchical gradient sum, parameter load.

One synchronous step per global batch. Worker ``i`` takes its slice of ``b_i``
samples, computes the batch-mean loss and its gradient, and scales the
gradient by ``b_i`` so the sum over workers is the sum of per-sample
gradients. The parameter server divides by the global sample count, steps the
optimizer and sends the parameters back (see :mod:`worker.engine.exchange`).
Model buffers (e.g. BatchNorm running statistics) are not exchanged: they stay
local to each worker.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import default_collate

from worker.engine import report
from worker.engine.contract import TrainingCode, default_metrics
from worker.engine.distributed import Topology
from worker.engine.exchange import (
    agree_dataset_sizes,
    broadcast_down,
    grads_to_vector,
    load_vector_,
    params_of,
    push_up,
    sum_over_world,
    sync_start,
)
from worker.engine.sharding import (
    contiguous_shard,
    even_shares,
    global_batches,
    steps_per_epoch,
    worker_slice,
)
from worker.engine.spec import RunSpec


@dataclass
class EpochWork:
    """What one worker did in one epoch: samples it trained on and seconds spent computing."""

    samples: int = 0
    compute_s: float = 0.0


def collate(dataset: Any, indices: Tensor | range) -> Any:
    """Stack the items ``dataset[i]`` for ``i`` in ``indices`` with torch's default collate."""
    return default_collate([dataset[int(i)] for i in indices])


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested tuple/list/dict) batch to ``device``."""
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def local_gradient(
    code: TrainingCode, model: torch.nn.Module, dataset: Any, indices: Tensor, device: torch.device
) -> Tensor:
    """Sum of per-sample gradients over ``indices`` plus ``[loss_sum, count]``, shape [P + 2].

    ``loss_fn`` returns the batch mean, so gradient and loss are scaled by the
    local count ``b``. With no samples the vector is all zeros.
    """
    params = params_of(model)
    model.zero_grad(set_to_none=True)
    count = len(indices)
    loss_sum = 0.0
    if count:
        inputs, target = to_device(collate(dataset, indices), device)
        loss = code.loss_fn(model(inputs), target)
        loss.backward()
        loss_sum = loss.item() * count
    grads = grads_to_vector(params) * count
    tail = torch.tensor([loss_sum, float(count)], dtype=grads.dtype, device=grads.device)
    return torch.cat([grads, tail])


def train_epoch(
    spec: RunSpec,
    code: TrainingCode,
    topo: Topology,
    model: torch.nn.Module,
    dataset: Any,
    epoch: int,
) -> EpochWork:
    """Run every step of one epoch on this worker; returns its samples and compute seconds."""
    params = params_of(model)
    work = EpochWork()
    model.train()
    batches = global_batches(len(dataset), spec.global_batch_size, spec.seed, epoch)
    for batch in batches:
        mine = worker_slice(batch, even_shares(len(batch), topo.n_workers), topo.worker_index)
        started = time.perf_counter()
        vector = local_gradient(code, model, dataset, mine, topo.device)
        work.compute_s += time.perf_counter() - started
        work.samples += len(mine)
        push_up(topo, vector)
        load_vector_(broadcast_down(topo, vector[:-2]), params)
    return work


@torch.no_grad()
def validate(
    code: TrainingCode, topo: Topology, model: torch.nn.Module, dataset: Sized, batch_size: int
) -> dict[str, tuple[float, float]]:
    """This worker's share of validation: ``name -> (value * count, count)`` summed over batches.

    Names are ``val_loss`` and ``val_<key>`` for each key of the user's
    ``metrics`` (or :func:`default_metrics`), weighted by batch size.
    """
    metrics_fn = code.metrics or default_metrics
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    shard = contiguous_shard(len(dataset), topo.n_workers, topo.worker_index)
    model.eval()
    for start in range(0, len(shard), batch_size):
        indices = shard[start : start + batch_size]
        inputs, target = to_device(collate(dataset, indices), topo.device)
        output = model(inputs)
        values = {"loss": float(code.loss_fn(output, target)), **metrics_fn(output, target)}
        for key, value in values.items():
            totals[f"val_{key}"][0] += float(value) * len(indices)
            totals[f"val_{key}"][1] += len(indices)
    model.train()
    return {k: (v[0], v[1]) for k, v in totals.items()}


def run_worker(
    spec: RunSpec,
    code: TrainingCode,
    topo: Topology,
    model: torch.nn.Module,
    datasets: tuple[Any, Any],
) -> Tensor:
    """Train as compute rank ``topo.rank`` until the last epoch; returns final parameters [P].

    Reports metric ``throughput`` (samples/s of this worker's compute time) once per epoch.
    Raises RuntimeError if workers' datasets differ in size, and whatever the user's code raises.
    """
    train_set, val_set = datasets
    agree_dataset_sizes(topo, (len(train_set), len(val_set)))
    model.to(topo.device)
    params = params_of(model)
    first_epoch, step = sync_start(topo, params)
    spe = steps_per_epoch(len(train_set), spec.global_batch_size)
    for epoch in range(first_epoch, spec.epochs):
        work = train_epoch(spec, code, topo, model, train_set, epoch)
        step += spe
        sum_over_world(validate(code, topo, model, val_set, spec.global_batch_size))
        rate = work.samples / work.compute_s if work.compute_s > 0 else 0.0
        report.metric("samples_per_s", rate, step=step, epoch=epoch, rank=topo.rank)
        report.log(
            f"rank {topo.rank} epoch {epoch}: {work.samples} samples, "
            f"{work.compute_s:.2f} s compute, {rate:.1f} samples/s"
        )
    return torch.nn.utils.parameters_to_vector(params).detach().cpu()
