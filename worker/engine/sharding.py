"""Splitting data between compute workers.

Every optimizer step draws one global batch from a per-epoch seeded permutation
of the training set; each compute worker takes its contiguous slice of that
batch. Within an epoch workers therefore see disjoint samples, and one
distributed step sees exactly the samples of one single-process step on the
same global batch (synchronous data parallelism as in Goyal et al., 2017).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor


def even_shares(n_samples: int, n_workers: int) -> list[int]:
    """Split ``n_samples`` into ``n_workers`` sizes that differ by at most 1 and sum exactly.

    The first ``n_samples % n_workers`` workers take one more sample. Raises
    ValueError if ``n_workers < 1`` or ``n_samples < 0``.
    """
    if n_workers < 1:
        raise ValueError(f"n_workers must be >= 1, got {n_workers}")
    if n_samples < 0:
        raise ValueError(f"n_samples must be >= 0, got {n_samples}")
    base, extra = divmod(n_samples, n_workers)
    return [base + (1 if i < extra else 0) for i in range(n_workers)]


def epoch_seed(seed: int, epoch: int) -> int:
    """Seed of the epoch's permutation: ``seed * 1000 + epoch``."""
    return seed * 1000 + epoch


def steps_per_epoch(n_items: int, global_batch_size: int) -> int:
    """Optimizer steps in one epoch; the last, partial batch counts as a step."""
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    return math.ceil(n_items / global_batch_size)


def global_batches(n_items: int, global_batch_size: int, seed: int, epoch: int) -> Iterator[Tensor]:
    """Yield the index tensors (int64, shape ``[<= global_batch_size]``) of each global batch.

    Indices come from ``torch.randperm(n_items)`` with a generator seeded by
    :func:`epoch_seed`, so every process derives the same batches. The last
    batch keeps the remainder. Raises ValueError if ``global_batch_size < 1``.
    """
    steps = steps_per_epoch(n_items, global_batch_size)
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    order = torch.randperm(n_items, generator=generator)
    for step in range(steps):
        yield order[step * global_batch_size : (step + 1) * global_batch_size]


def worker_slice(batch_indices: Tensor, shares: list[int], worker_index: int) -> Tensor:
    """The contiguous part of ``batch_indices`` that worker ``worker_index`` takes.

    ``shares`` are the per-worker sample counts (summing to ``len(batch_indices)``);
    the result has shape ``[shares[worker_index]]`` and may be empty. Raises
    ValueError if the shares do not sum to the batch length or the index is out of range.
    """
    if sum(shares) != len(batch_indices):
        raise ValueError(f"shares sum to {sum(shares)}, batch has {len(batch_indices)} items")
    if not 0 <= worker_index < len(shares):
        raise ValueError(f"worker_index {worker_index} out of range for {len(shares)} workers")
    start = sum(shares[:worker_index])
    return batch_indices[start : start + shares[worker_index]]


def contiguous_shard(n_items: int, n_workers: int, worker_index: int) -> range:
    """Item indices of worker ``worker_index`` in an even, contiguous split (e.g. validation)."""
    shares = even_shares(n_items, n_workers)
    start = sum(shares[:worker_index])
    return range(start, start + shares[worker_index])
