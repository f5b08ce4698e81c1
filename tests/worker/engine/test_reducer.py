"""The sync step's overlapped gradient sum (worker.engine.reducer) against the plain sum.

Real gloo process groups in fresh processes: every layout's reducer result must be the sum
of the workers' local vectors (worker.engine.compute.local_gradient) and bitwise the same on
every worker, with a frozen parameter, a parameter the forward pass does not use, buffers,
parameters used in another order than defined, and a worker without samples.
"""

from __future__ import annotations

import time
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.worker.engine.reference import run_ranks
from worker.engine import exchange
from worker.engine import reducer as reducer_module
from worker.engine.compute import local_gradient, reduced_gradient
from worker.engine.data import TensorData
from worker.engine.distributed import Topology, leader_ring, shard_links
from worker.engine.reducer import GradientReducer, plan_buckets
from worker.engine.shard_server import OwnerSum, RowSum
from worker.engine.state import ModelState


class Odd(nn.Module):
    """Layers used out of their definition order, one frozen, one unused, a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Linear(6, 3)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)
        self.early = nn.Linear(4, 6)

    def forward(self, x: Tensor) -> Tensor:
        return self.late(torch.relu(self.frozen(self.norm(self.early(x)))))


def _worker(
    rank: int,
    layout: list[int],
    counts: list[int],
    init: str,
    out: str,
    shards: int = 0,
    streams: bool = True,
) -> None:
    """A worker of ``layout``'s groups (ranks 0 .. W - 1); with ``shards`` S, ranks W .. W + S -
    1 own the slices of the groups' sum (worker.engine.shard_server: each member sends its
    chunk of its group's sum, OwnerSum; each owner sums the groups' parts, RowSum), in
    buckets and pieces of a few elements so that every step sends many pieces as backward
    goes (or, not ``streams``, as a CUDA group does: its CPU copy at the end)."""
    workers = sum(layout)
    world = workers + shards
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    firsts = [sum(layout[:g]) for g in range(len(layout))]
    groups = [dist.new_group(list(range(f, f + n))) for f, n in zip(firsts, layout, strict=True)]
    cross = leader_ring(firsts, rank, {}, timedelta(seconds=60))
    links = None
    if shards:
        exchange.PIECE_BYTES = 32  # 8 float32 elements
        reducer_module.plan_buckets = partial(plan_buckets, first=64, rest=128)
        servers = list(range(workers, world))
        links = shard_links(servers, list(range(workers)), rank, timedelta(seconds=60))
    if rank >= workers:  # a shard owner: two steps' sums of its slice
        assert links is not None and links.shard is not None
        state = ModelState.of(Odd())
        numel = state.n_params + state.n_buffers + 2
        spec = SimpleNamespace(
            groups=layout,
            group_ranks=lambda g: list(range(firsts[g], firsts[g] + layout[g])),
            sharded=lambda g: False,
        )
        rows = RowSum(spec, numel, [], shards, links.shard)  # type: ignore[arg-type]
        for _ in range(2):
            rows.serve(links, torch.float32, range(len(layout)))
        dist.destroy_process_group()
        return
    index = max(g for g, f in enumerate(firsts) if f <= rank)
    ranks = tuple(range(firsts[index], firsts[index] + layout[index]))
    topo = Topology(
        rank=rank,
        world_size=world,
        n_workers=world,
        group_index=index,
        group=groups[index],
        group_ranks=ranks,
        device=torch.device("cpu"),
        cross=cross,
        shards=links,
    )
    torch.manual_seed(0)
    model = Odd()
    generator = torch.Generator().manual_seed(100 + rank)
    n = counts[rank]
    data = TensorData.from_batch((torch.randn(n, 4, generator=generator), torch.randn(n, 3)))
    code = SimpleNamespace(loss_fn=nn.functional.mse_loss)
    indices = torch.arange(counts[rank])
    state = ModelState.of(model)
    base = state.snapshot()
    local = local_gradient(code, model, data, indices, topo.device, state, base)  # type: ignore[arg-type]
    state.restore(base)
    owners = None
    if shards:
        owners = OwnerSum(topo, state.n_params + state.n_buffers + 2)
    reducer = GradientReducer(
        topo, list(model.parameters()), state.n_buffers + 2, len(layout), owners=owners
    )
    assert len(reducer.buckets) > (3 if shards else 0)
    reducer.streams = reducer.streams and streams
    results = []
    for _ in range(2):  # the hooks work again in the next step
        state.restore(base)
        reduced_gradient(code, model, data, indices, topo.device, state, base, reducer)  # type: ignore[arg-type]
        results.append(reducer.finish().clone())
    torch.save({"local": local, "reduced": results}, Path(out) / f"{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("layout", "counts", "shards"),
    [
        ([2, 2], [5, 0, 3, 4], 0),  # in-group sums, the leaders' sum, the in-group broadcast
        ([1, 1], [3, 6], 0),  # one worker per group: the hooks launch the leaders' sum
        ([1, 1, 1], [3, 6, 2], 0),  # the same over a ring of three links (worker.engine.ring)
        ([2, 1, 2], [4, 0, 5, 3, 2], 0),  # in-group sums, then the ring, then the broadcast
        ([3], [2, 7, 3], 0),  # one group: the in-group sum is all
        # The parameter server's shards sum across the groups: one worker per group (each
        # piece sent as backward writes it), and groups of two (once summed in the group).
        ([1, 1, 1], [3, 6, 2], 3),
        ([2, 1, 2], [4, 0, 5, 3, 2], 2),
        # chunks across slices: a member sends to two owners, an owner takes a group's part
        # of its slice from two members
        ([2, 1, 2], [4, 0, 5, 3, 2], 3),
        ([3, 2], [2, 4, 0, 3, 5], 2),
        ([2, 1, 2], [4, 0, 5, 3, 2], -2),  # the same, the whole vector sent at the end
    ],
)
def test_overlapped_sum_equals_the_sum_of_local_vectors(
    layout: list[int], counts: list[int], shards: int, tmp_path: Path
) -> None:
    init = f"file://{tmp_path / 'store'}"
    world = sum(layout) + abs(shards)
    args = (layout, counts, init, str(tmp_path), abs(shards), shards >= 0)
    codes = run_ranks(_worker, world, *args)
    assert codes == [0] * world
    outs = [torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(sum(layout))]
    expected = torch.stack([o["local"] for o in outs]).sum(0)
    first = outs[0]["reduced"][0]
    assert float(first[-1]) == sum(counts)  # the count, in the tail
    torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-6)
    model = Odd()
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen and int((first == 0).sum()) >= frozen  # frozen and unused parameters: zeros
    for out in outs:
        for reduced in out["reduced"]:
            assert torch.equal(reduced, first)  # the same bits everywhere, step after step


def test_buckets_run_backwards_with_a_small_first_one() -> None:
    sizes = [100, 300_000, 10, 10, 200_000, 5]
    buckets = plan_buckets(sizes, 4, first=1 * 2**20, rest=2 * 2**20)
    assert buckets[0] == (2, 6)  # 200,025 floats fit the 1 MiB first bucket, 300,000 more not
    assert buckets[1] == (0, 2)  # the rest within 2 MiB
    covered = [i for start, stop in buckets for i in range(start, stop)]
    assert sorted(covered) == list(range(len(sizes)))  # every parameter exactly once
    assert all(buckets[k][0] == buckets[k + 1][1] for k in range(len(buckets) - 1))
    assert plan_buckets([10**6], 4, first=100, rest=100) == [(0, 1)]  # too big: alone
    assert plan_buckets([], 4) == []


def _status_peer(rank: int, init: str, delay_s: float, out: str) -> None:
    from datetime import timedelta

    from worker.engine.exchange import receive_status, send_status

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=2)
    )
    world = dist.group.WORLD
    topo = SimpleNamespace(link=lambda peer: world)
    if rank == 1:
        time.sleep(delay_s)
        send_status(topo, "non-finite loss on rank 1")  # type: ignore[arg-type]
    else:
        Path(out).write_text(str(receive_status(topo, 1)))  # type: ignore[arg-type]
    dist.destroy_process_group()


def test_the_parameter_server_waits_for_a_status_longer_than_the_group_timeout(
    tmp_path: Path,
) -> None:
    """An epoch without control points may outlast the process groups' timeout (2 s here)."""
    out = tmp_path / "status"
    assert run_ranks(_status_peer, 2, f"file://{tmp_path / 'store'}", 4.0, str(out)) == [0, 0]
    assert out.read_text() == "non-finite loss on rank 1"
