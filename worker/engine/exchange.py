"""The hierarchical gradient/parameter exchange between workers and the parameter server.

Gradients go up: allreduce (sum) inside each resource group, then the group
leaders reduce (sum) to the parameter server over the leaders group.
Parameters come down: the parameter server broadcasts to the leaders, each
leader broadcasts inside its group. This is hierarchical allreduce with a
parameter server at the top (Li et al., OSDI 2014). Vectors are flat 1-D
tensors so each hop is one collective.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from worker.engine.distributed import Topology


def params_of(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The model's parameters, in the fixed order used for every flat vector."""
    return list(model.parameters())


def grads_to_vector(params: Iterable[torch.nn.Parameter]) -> Tensor:
    """Concatenate gradients into one 1-D tensor; a parameter without gradient gives zeros."""
    parts = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1) for p in params
    ]
    return torch.cat(parts)


def vector_to_grads(vector: Tensor, params: Iterable[torch.nn.Parameter]) -> None:
    """Set ``.grad`` of each trainable parameter from its slice of ``vector``.

    Frozen parameters (``requires_grad=False``) keep ``grad=None`` so the
    optimizer skips them, as it would in one process.
    """
    offset = 0
    for p in params:
        n = p.numel()
        if p.requires_grad:
            p.grad = vector[offset : offset + n].view_as(p).clone()
        offset += n


@torch.no_grad()
def load_vector_(vector: Tensor, params: Iterable[torch.nn.Parameter]) -> None:
    """Copy ``vector`` into the parameters in place (parameter identity is kept,
    unlike ``torch.nn.utils.vector_to_parameters`` which rebinds ``.data``)."""
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(vector[offset : offset + n].view_as(p))
        offset += n


def push_up(topo: Topology, vector: Tensor) -> None:
    """Worker side of the upward sum: allreduce in the group, leader reduces to rank 0.

    ``vector`` (1-D, on ``topo.device``) is summed in place inside the group.
    """
    if topo.group is None:
        raise RuntimeError("push_up is for compute workers")
    dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=topo.group)
    if topo.am_i_leader:
        dist.reduce(vector.cpu(), dst=0, op=dist.ReduceOp.SUM, group=topo.leaders)


def gather_at_ps(topo: Topology, numel: int, dtype: torch.dtype) -> Tensor:
    """Parameter-server side of the upward sum: returns the sum over all workers, shape [numel]."""
    total = torch.zeros(numel, dtype=dtype)
    dist.reduce(total, dst=0, op=dist.ReduceOp.SUM, group=topo.leaders)
    return total


def broadcast_down(topo: Topology, vector: Tensor) -> Tensor:
    """Send ``vector`` from the parameter server to every worker; returns the received tensor.

    On rank 0 ``vector`` is the payload (CPU); elsewhere it only gives shape and
    dtype and is overwritten. The result lives on ``topo.device``.
    """
    if topo.is_ps:
        dist.broadcast(vector, src=0, group=topo.leaders)
        return vector
    assert topo.group is not None and topo.leader_rank is not None
    received = vector.to(topo.device)
    if topo.am_i_leader:
        on_cpu = received.cpu()
        dist.broadcast(on_cpu, src=0, group=topo.leaders)
        received = on_cpu.to(topo.device)
    dist.broadcast(received, src=topo.leader_rank, group=topo.group)
    return received


def agree_dataset_sizes(topo: Topology, sizes: tuple[int, int] | None) -> tuple[int, int]:
    """Every rank learns ``(n_train, n_val)``; workers pass theirs, the parameter server None.

    One MAX allreduce over the world of ``[n, -n]`` pairs yields the largest and
    smallest value at once. Raises RuntimeError on every rank if workers disagree
    (``build_datasets`` must be deterministic).
    """
    floor = -(2**62)
    mine = [floor] * 4 if sizes is None else [sizes[0], -sizes[0], sizes[1], -sizes[1]]
    t = torch.tensor(mine, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    n_train, neg_min_train, n_val, neg_min_val = (int(v) for v in t)
    if n_train != -neg_min_train or n_val != -neg_min_val:
        raise RuntimeError(
            "workers built datasets of different sizes: train "
            f"{-neg_min_train}..{n_train}, validation {-neg_min_val}..{n_val}"
        )
    return n_train, n_val


def sum_over_world(totals: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """Sum ``name -> (weighted_sum, count)`` pairs over every rank of the world.

    Ranks may hold different names (a worker with no validation samples holds
    none); names are first united with one all_gather_object, then the values
    are summed by one float64 allreduce.
    """
    names_per_rank: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(names_per_rank, sorted(totals))
    names = sorted({n for rank_names in names_per_rank for n in rank_names or []})
    flat = torch.zeros(2 * len(names), dtype=torch.float64)
    for i, name in enumerate(names):
        flat[2 * i], flat[2 * i + 1] = totals.get(name, (0.0, 0.0))
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return {name: (float(flat[2 * i]), float(flat[2 * i + 1])) for i, name in enumerate(names)}


def sync_start(
    topo: Topology, params: list[torch.nn.Parameter], epoch: int = 0, step: int = 0
) -> tuple[int, int]:
    """Give every worker the parameter server's parameters and starting point.

    On rank 0, ``params`` are the source and ``epoch``/``step`` the first epoch
    to run and the optimizer steps already done (non-zero after a resume);
    elsewhere ``params`` are overwritten and the arguments ignored.
    Returns ``(epoch, step)`` as sent by rank 0.
    """
    meta = broadcast_down(topo, torch.tensor([epoch, step], dtype=torch.int64))
    with torch.no_grad():
        vector = torch.nn.utils.parameters_to_vector(params).detach()
    received = broadcast_down(topo, vector.cpu() if topo.is_ps else vector)
    if not topo.is_ps:
        load_vector_(received, params)
    return int(meta[0]), int(meta[1])
