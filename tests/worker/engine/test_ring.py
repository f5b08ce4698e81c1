"""worker.engine.ring.LeaderRing: the group leaders' allreduce over a ring of two-rank links
gives every member the reduction of all members' tensors, bitwise the same on each, whatever
the tensor's size against the number of members, with each op the control collectives use,
and in launch order when several run at once (the gradient reducer's buckets).

Real gloo process groups in forked processes; rank 0 stands for the parameter server, which
is in no ring (as in a task), so the ring's members are global ranks 1..G.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.worker.engine.reference import leave_with_record, run_ranks
from worker.engine.distributed import add_ring_links
from worker.engine.ring import LeaderRing, ring_pairs

# Element counts: fewer than the members (empty chunks), one that does not divide, a larger one.
SIZES = (1, 2, 7, 1001)


def _tensor(rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s input: values whose float32 sums round differently by order."""
    gen = torch.Generator().manual_seed(1000 * rank + size)
    return torch.randn(size, generator=gen) * 10.0 ** torch.randint(-3, 4, (size,), generator=gen)


def _rank(rank: int, world: int, init: str, out: str) -> None:
    timeout = timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timeout)
    members = list(range(1, world))
    links: dict[frozenset[int], dist.ProcessGroup] = {}
    add_ring_links(members, rank, links, timeout)  # every rank, the server too
    record: dict[str, object] = {"links": len(links)}
    if rank in members:
        ring = LeaderRing(members, rank, links, timeout)
        sums = {}
        for size in SIZES:
            tensor = _tensor(rank, size)
            ring.all_reduce(tensor)
            sums[size] = tensor.tolist()
        record["sum"] = sums
        biggest = _tensor(rank, 50).reshape(5, 10)
        ring.all_reduce(biggest, op=dist.ReduceOp.MAX)
        record["max"] = biggest.reshape(-1).tolist()
        # Launched together, waited later: each lands in its own tensor.
        buckets = [torch.full((size,), float(rank * size)) for size in (3, 11, 40)]
        works = [ring.all_reduce(b, async_op=True) for b in buckets]
        for work in works:
            work.wait()
        record["buckets"] = [b.tolist() for b in buckets]
        try:
            ring.all_reduce(torch.zeros(4, 4).t())
        except ValueError as exc:
            record["refused"] = str(exc)
    leave_with_record(out, rank, record)


@pytest.mark.parametrize("members", [2, 3, 4])
def test_the_ring_sums_bitwise_alike_on_every_member(tmp_path: Path, members: int) -> None:
    world = members + 1
    init = f"file://{tmp_path / 'rendezvous'}"
    codes = run_ranks(_rank, world, world, init, str(tmp_path))
    assert codes == [0] * world
    records = {r: json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(world)}
    assert (
        records[0]["links"]
        == len(ring_pairs(list(range(1, world))))
        == (1 if members == 2 else members)
    )
    first = records[1]
    for r in range(2, world):  # the same bits on every member
        assert records[r]["sum"] == first["sum"]
        assert records[r]["max"] == first["max"]
        assert records[r]["buckets"] == first["buckets"]
    for size in SIZES:
        expected = torch.stack([_tensor(r, size) for r in range(1, world)]).double().sum(0)
        got = torch.tensor(first["sum"][str(size)], dtype=torch.float64)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    expected_max = torch.stack([_tensor(r, 50) for r in range(1, world)]).amax(0)
    assert first["max"] == expected_max.tolist()
    for size, bucket in zip((3, 11, 40), first["buckets"], strict=True):
        assert bucket == [float(sum(r * size for r in range(1, world)))] * size
    assert "contiguous" in first["refused"]


def test_a_ring_refuses_a_rank_outside_it() -> None:
    with pytest.raises(ValueError, match="cannot form a ring"):
        LeaderRing([1, 2, 3], 0, {}, timedelta(seconds=1))
    assert ring_pairs([4]) == []
    assert ring_pairs([1, 2]) == [frozenset({1, 2})]


def _rank_with_a_peer_gone(rank: int, init: str, out: str) -> None:
    timeout = timedelta(seconds=30)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4, timeout=timeout)
    members = [1, 2, 3]
    links: dict[frozenset[int], dist.ProcessGroup] = {}
    add_ring_links(members, rank, links, timeout)
    # No rank leaves before every rank's links are made (a pair half made when its peer
    # exits fails to connect, as it did on a loaded host): each says so in a file.
    Path(out, f"linked-{rank}").touch()
    while len(list(Path(out).glob("linked-*"))) < 4:
        time.sleep(0.01)
    if rank in (0, 3):  # the server idles; member 3 leaves before any allreduce
        os._exit(0)
    ring = LeaderRing(members, rank, links, timeout)
    works = [ring.all_reduce(torch.ones(30), async_op=True) for _ in range(2)]
    errors = []
    for work in works:
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 (recorded for the test)
            errors.append(type(exc).__name__)
    Path(out, f"rank-{rank}.json").write_text(json.dumps(errors))
    os._exit(0)


def test_a_member_gone_fails_every_allreduce_queued_instead_of_hanging(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'rendezvous'}"
    assert run_ranks(_rank_with_a_peer_gone, 4, init, str(tmp_path)) == [0] * 4
    for rank in (1, 2):  # each of the two queued allreduces raised: none waited for good
        errors = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert len(errors) == 2, errors
