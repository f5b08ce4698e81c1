"""Data splitting: shares, global batches and worker slices."""

from __future__ import annotations

import pytest
import torch

from worker.engine.sharding import (
    apportion,
    contiguous_shard,
    even_shares,
    global_batches,
    steps_per_epoch,
    weighted_shares,
    worker_slice,
)


@pytest.mark.parametrize("n_samples,n_workers", [(0, 3), (2, 3), (7, 3), (64, 3), (100, 7), (5, 1)])
def test_even_shares_sum_exactly_and_differ_by_at_most_one(n_samples: int, n_workers: int) -> None:
    shares = even_shares(n_samples, n_workers)
    assert len(shares) == n_workers
    assert sum(shares) == n_samples
    assert max(shares) - min(shares) <= 1
    assert shares == sorted(shares, reverse=True)


def test_even_shares_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        even_shares(5, 0)
    with pytest.raises(ValueError):
        even_shares(-1, 2)


def test_global_batches_cover_every_item_once_and_keep_last_partial_batch() -> None:
    batches = list(global_batches(23, 5, seed=3, epoch=1))
    assert [len(b) for b in batches] == [5, 5, 5, 5, 3]
    assert len(batches) == steps_per_epoch(23, 5)
    assert sorted(torch.cat(batches).tolist()) == list(range(23))


def test_global_batches_are_deterministic_per_seed_and_epoch() -> None:
    first = torch.cat(list(global_batches(50, 8, seed=1, epoch=0)))
    again = torch.cat(list(global_batches(50, 8, seed=1, epoch=0)))
    next_epoch = torch.cat(list(global_batches(50, 8, seed=1, epoch=1)))
    other_seed = torch.cat(list(global_batches(50, 8, seed=2, epoch=0)))
    assert torch.equal(first, again)
    assert not torch.equal(first, next_epoch)
    assert not torch.equal(first, other_seed)


def test_worker_slices_are_disjoint_contiguous_and_cover_the_batch() -> None:
    batch = torch.tensor([9, 4, 7, 1, 0, 3, 8])
    shares = even_shares(len(batch), 3)
    slices = [worker_slice(batch, shares, i) for i in range(3)]
    assert [len(s) for s in slices] == [3, 2, 2]
    assert torch.equal(torch.cat(slices), batch)


def test_worker_slice_may_be_empty_when_batch_is_smaller_than_world() -> None:
    batch = torch.tensor([5, 6])
    shares = even_shares(2, 3)
    assert worker_slice(batch, shares, 2).numel() == 0


def test_worker_slice_rejects_inconsistent_shares() -> None:
    with pytest.raises(ValueError):
        worker_slice(torch.arange(5), [2, 2], 0)
    with pytest.raises(ValueError):
        worker_slice(torch.arange(4), [2, 2], 2)


def test_epoch_slices_of_all_workers_partition_the_training_set() -> None:
    seen: list[list[int]] = [[], [], []]
    for batch in global_batches(31, 7, seed=0, epoch=2):
        shares = even_shares(len(batch), 3)
        for i in range(3):
            seen[i] += worker_slice(batch, shares, i).tolist()
    assert sorted(seen[0] + seen[1] + seen[2]) == list(range(31))
    assert not set(seen[0]) & set(seen[1]) and not set(seen[1]) & set(seen[2])


def test_contiguous_shards_partition_the_range() -> None:
    shards = [contiguous_shard(10, 3, i) for i in range(3)]
    assert [list(s) for s in shards] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_weighted_contiguous_shards_follow_the_weights() -> None:
    """Validation by speed: a worker with a third of the batch share validates a third as
    many items; one left out (share 0) validates none; the blocks still cover the set once."""
    shards = [contiguous_shard(12, 3, i, [6.0, 2.0, 0.0]) for i in range(3)]
    assert [list(s) for s in shards] == [list(range(9)), [9, 10, 11], []]
    with pytest.raises(ValueError, match="2 weights for 3 workers"):
        contiguous_shard(12, 3, 0, [1.0, 1.0])


@pytest.mark.parametrize(
    "total,weights",
    [(128, [3.0, 1.0]), (7, [1.0, 1.0, 1.0]), (10, [0.5, 0.3, 0.2]), (5, [1e-9, 1.0]), (0, [1.0])],
)
def test_apportion_sums_exactly_and_is_proportional(total: int, weights: list[float]) -> None:
    counts = apportion(total, weights)
    assert sum(counts) == total
    exact = [total * w / sum(weights) for w in weights]
    assert all(abs(c - x) < 1 for c, x in zip(counts, exact, strict=True))


def test_apportion_rejects_bad_weights() -> None:
    for weights in ([], [-1.0, 2.0], [float("nan")], [0.0, 0.0]):
        with pytest.raises(ValueError):
            apportion(4, weights)


def test_weighted_shares_keep_every_worker_measurable() -> None:
    assert weighted_shares(128, [3.0, 1.0]) == [96, 32]
    assert weighted_shares(4, [1000.0, 1.0, 1.0]) == [2, 1, 1]
    assert sum(weighted_shares(9, [5.0, 0.0, 0.0])) == 9
