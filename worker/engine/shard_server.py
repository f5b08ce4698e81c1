"""The parameter server in S shards (``RunSpec.ps_shards`` > 1): what rank 0, the other shard
owners and the group leaders say to each other, for ``periodic`` model averaging.

The P parameters are cut into S contiguous slices (:func:`worker.engine.exchange.shard_bounds`);
slice s is owned by ``RunSpec.shard_servers()[s]``: rank 0 for slice 0, then the ranks after
the last compute worker, which build no model and train nothing (:func:`serve`). At a sync
point:

1. rank 0 tells every other owner which groups take part (:data:`MEAN`, the guard's parked
   groups left out);
2. each taking group's leader sends slice s of ``n_g * theta_g`` to its owner, with ``n_g``
   (the group's samples since the last sync) appended; slice 0 also carries the group's
   buffer changes and its loss sum (the layout of the unsharded round,
   :mod:`worker.engine.strategy_periodic`), and takes every answer back
   (:func:`worker.engine.exchange.sharded_round`);
3. each owner adds its slices in leader order, divides by the sum of the ``n_g``, answers the
   leaders with its slice of the global model, and sends it to rank 0 as well.

The result is bitwise the unsharded server's: every element is the same sum in the same order,
divided by the same count. Each owner's link carries G / S of the groups' bytes each way where
one server's carried all of them (BytePS, Jiang et al., OSDI 2020); rank 0 receives the other
(S - 1) / S of the model each round besides, as it keeps the whole model for the checkpoints,
validation and the control points (a group the guard takes back receives it from rank 0).
At each epoch's start rank 0 sends every owner its slice of the global model (:data:`LOAD`),
which the owner answers with in a round where no group took a sample; at the end it sends
:data:`STOP`. A command waits as long as an epoch's end takes (:data:`exchange.STATUS_WAIT`);
a rank that is gone fails it at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from worker.engine.distributed import CONTROL_TAG, Topology
from worker.engine.exchange import (
    STATUS_WAIT,
    load_vector_,
    post_pieces,
    receive_pieces,
    serve_shard,
    shard_bounds,
    sharded_round,
    wait_all,
)
from worker.engine.state import ModelState

STOP, LOAD, MEAN = 0, 1, 2
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _owners(topo: Topology) -> tuple[int, ...]:
    assert topo.shards is not None, "the parameter server is not sharded"
    return topo.shards.servers


def _command(
    topo: Topology, op: int, bounds: list[tuple[int, int]], dtype: torch.dtype, leaders: list[int]
) -> None:
    """Rank 0: send ``[op, numel, dtype, one flag per group]`` to every other owner, ``numel``
    its slice's length (``bounds``: every shard's, :func:`shard_bounds`); a flag says the
    group's leader takes part in the round."""
    taking = set(leaders)
    flags = [1 if ranks[0] in taking else 0 for ranks in topo.groups]
    for owner, (a, b) in zip(_owners(topo)[1:], bounds[1:], strict=True):
        header = torch.tensor([op, b - a, DTYPES.index(dtype), *flags], dtype=torch.int64)
        dist.send(header, dst=owner, group=topo.link(owner), tag=CONTROL_TAG)


def load(topo: Topology, state: ModelState) -> None:
    """Rank 0, at each epoch's start: send every other owner its slice of the global model's
    parameters (:data:`LOAD`)."""
    flat = torch.nn.utils.parameters_to_vector(state.params).detach().cpu()
    bounds = shard_bounds(flat.numel(), len(_owners(topo)))
    _command(topo, LOAD, bounds, flat.dtype, [])
    wait_all(
        [
            w
            for owner, (a, b) in zip(_owners(topo)[1:], bounds[1:], strict=True)
            for w in post_pieces(flat[a:b], owner, topo.link(owner))
        ]
    )


def stop(topo: Topology) -> None:
    """Rank 0, when training is over: every other owner returns from :func:`serve`."""
    _command(topo, STOP, [(0, 0)] * len(_owners(topo)), torch.float32, [])


def serve(topo: Topology) -> None:
    """A shard owner other than rank 0: answer rank 0's commands until :data:`STOP`.

    Raises RuntimeError for a round before any :data:`LOAD`, and what a receive raises (a
    peer gone, or no command within :data:`exchange.STATUS_WAIT`).
    """
    assert topo.shards is not None and topo.shards.shard not in (None, 0)
    header = torch.empty(3 + len(topo.groups), dtype=torch.int64)
    held: Tensor | None = None
    while True:
        work = dist.irecv(header, src=0, group=topo.link(0), tag=CONTROL_TAG)
        assert work is not None
        work.wait(STATUS_WAIT)
        op, numel, dtype = int(header[0]), int(header[1]), DTYPES[int(header[2])]
        if op == STOP:
            return
        if op == LOAD:
            held = torch.empty(numel, dtype=dtype)
            wait_all(receive_pieces(held, 0, topo.link(0)))
            continue
        if held is None or held.numel() != numel:
            raise RuntimeError(f"shard {topo.shards.shard}: a round before its slice was loaded")
        leaders = [ranks[0] for ranks, flag in zip(topo.groups, header[3:], strict=True) if flag]
        held = serve_shard(topo.shards, numel + 1, dtype, _mean(held), leaders)
        wait_all(post_pieces(held, 0, topo.link(0)))


def _mean(held: Tensor) -> Callable[[Tensor], Tensor]:
    """The owner's answer to ``[sum of n_g theta_g slices, sum of n_g]``: the mean slice, or
    ``held`` (the global model's slice) when no sample was taken."""

    def answer(total: Tensor) -> Tensor:
        count = float(total[-1])
        return total[:-1] / total[-1] if count > 0 else held

    return answer


def leader_round(topo: Topology, weighted: Tensor, tail: Tensor) -> Tensor:
    """A group leader's side of a sharded sync point: ``weighted`` [P] is ``n_g * theta_g``,
    ``tail`` [B + 2] the buffer changes, the loss sum and ``n_g``; returns the global model's
    ``[params (P), buffers (B)]`` on CPU (the leader then broadcasts it in its group)."""
    weighted, tail = weighted.detach().cpu(), tail.detach().cpu()
    samples = tail[-1:]
    bounds = shard_bounds(weighted.numel(), len(_owners(topo)))
    slices = [torch.cat([weighted[a:b], samples]) for a, b in bounds]
    slices[0] = torch.cat([weighted[bounds[0][0] : bounds[0][1]], tail])
    n_buffers = tail.numel() - 2
    outs = [torch.empty(b - a, dtype=weighted.dtype) for a, b in bounds]
    outs[0] = torch.empty(bounds[0][1] + n_buffers, dtype=weighted.dtype)
    assert topo.shards is not None
    sharded_round(topo.shards, slices, outs)
    head = bounds[0][1]
    return torch.cat([outs[0][:head], *outs[1:], outs[0][head:]])


def server_round(topo: Topology, state: ModelState, leaders: list[int]) -> tuple[float, float]:
    """Rank 0's side of a sharded sync point with the groups of ``leaders`` (global ranks):
    command the other owners, serve shard 0 (its parameters' slice and the buffers), then
    take the other owners' slices; the model ends as the unsharded average would leave it.
    Returns the round's ``(loss sum, samples)`` over the groups."""
    flat = torch.nn.utils.parameters_to_vector(state.params).detach().cpu()
    bounds = shard_bounds(flat.numel(), len(_owners(topo)))
    head, n_buffers = bounds[0][1], state.n_buffers
    _command(topo, MEAN, bounds, flat.dtype, leaders)
    sums: list[float] = []

    def answer(total: Tensor) -> Tensor:
        count = float(total[-1])
        sums.extend([float(total[-2]), count])
        if count > 0:
            flat[:head] = total[:head] / total[-1]
            state.add_mean_change(None, total[head : head + n_buffers], count)
        return torch.cat([flat[:head], state.buffers_vector().cpu()])

    assert topo.shards is not None
    serve_shard(topo.shards, head + n_buffers + 2, flat.dtype, answer, leaders)
    wait_all(
        [
            w
            for owner, (a, b) in zip(_owners(topo)[1:], bounds[1:], strict=True)
            for w in receive_pieces(flat[a:b], owner, topo.link(owner))
        ]
    )
    load_vector_(flat, state.params)
    return sums[0], sums[1]
