"""A parameter server in S shards (worker.engine.exchange.sharded_round / serve_shard): every
group leader gets the same answer, bitwise, as from one unsharded server (the sum of the
leaders' vectors in leader order, then the server's answer), for S = 1, 2 and 3, vectors that
S does not divide and vectors longer than one piece; a round over some of the leaders (the
others parked) leaves the others out; bad layouts are refused naming the problem.

Real gloo process groups in forked processes: ranks 0..S-1 own the shards, S.. are leaders.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.worker.engine.reference import leave_with_record, run_ranks
from worker.engine import exchange
from worker.engine.distributed import shard_links
from worker.engine.exchange import serve_shard, shard_bounds, sharded_round

# The ranks send in pieces of 4 KiB here (exchange.PIECE_BYTES, 4 MiB in a task), so a vector
# of a few thousand elements takes several.
PIECE_BYTES = 4096
# Element counts: fewer than a piece, not divisible by the shards, more than two pieces.
SIZES = (7, 1001, 2 * PIECE_BYTES // 4 + 13)
LEADERS = 3


def _vector(leader: int, size: int) -> torch.Tensor:
    """Leader ``leader``'s vector: values whose float32 sums round differently by order."""
    gen = torch.Generator().manual_seed(1000 * leader + size)
    return torch.randn(size, generator=gen) * 10.0 ** torch.randint(-3, 4, (size,), generator=gen)


def _expected(size: int, leaders: list[int]) -> torch.Tensor:
    """One unsharded server's answer: the leaders' vectors added in leader order, halved."""
    total = _vector(leaders[0], size).clone()
    for leader in leaders[1:]:
        total += _vector(leader, size)
    return total / 2


SHARDS = (1, 2, 3)


def _rank(rank: int, world: int, init: str, out: str) -> None:
    """Rank ``rank`` of one world of 3 servers and 3 leaders, through every S of
    :data:`SHARDS` in turn (the servers past S wait)."""
    timeout = timedelta(seconds=60)
    exchange.PIECE_BYTES = PIECE_BYTES
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timeout)
    leaders = list(range(max(SHARDS), world))
    record: dict[str, object] = {}
    for shards in SHARDS:
        links = shard_links(list(range(shards)), leaders, rank, timeout)
        mine: dict[str, object] = {"links": sorted(map(list, links.links))}
        rounds = [(size, leaders) for size in SIZES] + [(SIZES[1], leaders[::2])]  # 2 parked
        answers = []
        for size, taking_part in rounds:
            if links.shard is not None:
                a, b = shard_bounds(size, shards)[links.shard]
                answer = serve_shard(links, b - a, torch.float32, lambda t: t / 2, taking_part)
                answers.append(answer.tolist())
            elif rank in taking_part:
                vector, got = _vector(rank, size), torch.full((size,), float("nan"))
                bounds = shard_bounds(size, shards)
                slices = [vector[a:b] for a, b in bounds]
                sharded_round(links, slices, [got[a:b] for a, b in bounds])
                answers.append(got.tolist())
        mine["answers"] = answers
        record[str(shards)] = mine
    if rank in leaders:
        links = shard_links([0], leaders, rank, timeout)
        try:
            serve_shard(links, 4, torch.float32, lambda t: t)
        except ValueError as exc:
            record["not_a_server"] = str(exc)
        try:
            sharded_round(links, [torch.zeros(1)], [torch.zeros(1)] * 2)
        except ValueError as exc:
            record["mismatch"] = str(exc)
    else:
        shard_links([0], leaders, rank, timeout)  # every rank makes every group
    leave_with_record(out, rank, record)


def test_every_leader_gets_the_unsharded_answer_bitwise(tmp_path: Path) -> None:
    world = max(SHARDS) + LEADERS
    codes = run_ranks(_rank, world, world, f"file://{tmp_path / 'rdv'}", str(tmp_path))
    assert codes == [0] * world
    every = {r: json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(world)}
    leaders = list(range(max(SHARDS), world))
    for shards in SHARDS:
        records = {r: every[r][str(shards)] for r in range(world)}
        # Each server holds a link to every leader, each leader one to every server.
        for server in range(shards):
            assert records[server]["links"] == [[server, leader] for leader in leaders]
        for leader in leaders:
            assert records[leader]["links"] == [[server, leader] for server in range(shards)]
        rounds = [(size, leaders) for size in SIZES] + [(SIZES[1], leaders[::2])]
        for leader in leaders:
            mine = [(size, part) for size, part in rounds if leader in part]
            assert len(records[leader]["answers"]) == len(mine)
            for (size, part), got in zip(mine, records[leader]["answers"], strict=True):
                assert torch.equal(torch.tensor(got), _expected(size, part)), (shards, leader)
        # Each server answered its own slice of each round, no more; the others none.
        for server in range(shards):
            for (size, part), got in zip(rounds, records[server]["answers"], strict=True):
                a, b = shard_bounds(size, shards)[server]
                assert torch.equal(torch.tensor(got), _expected(size, part)[a:b])
        for idle in range(shards, max(SHARDS)):
            assert records[idle]["answers"] == []
    assert "owns no shard" in every[leaders[0]]["not_a_server"]
    assert "1 slices and 2 answers for 1 shards" in every[leaders[0]]["mismatch"]


def test_shard_bounds_cover_the_vector_in_near_equal_slices() -> None:
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert shard_bounds(5, 1) == [(0, 5)]
    for numel, shards in [(1, 1), (17, 5), (1 << 20, 4)]:
        bounds = shard_bounds(numel, shards)
        assert bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(a == prev_b for (a, _), (_, prev_b) in zip(bounds[1:], bounds, strict=False))
        sizes = [b - a for a, b in bounds]
        assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="cannot cut 3 elements into 4 shards"):
        shard_bounds(3, 4)
    with pytest.raises(ValueError, match="into 0 shards"):
        shard_bounds(3, 0)


def test_shard_links_refuse_a_rank_that_is_both_server_and_leader() -> None:
    with pytest.raises(ValueError, match="must not share a rank"):
        shard_links([0, 1], [1, 2], 0, timedelta(seconds=1))
    with pytest.raises(ValueError, match="repeated"):
        shard_links([0, 0], [1, 2], 0, timedelta(seconds=1))
