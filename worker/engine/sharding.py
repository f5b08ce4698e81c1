"""Sample counts and index helpers for splitting data between compute workers.

Counts: :func:`even_shares` and :func:`apportion` (largest remainder, so
shares always sum exactly to the global batch) with :func:`weighted_shares`
for throughput-proportional splits and :func:`capped_shares` for such splits within
per-worker caps (a group's ``max_local_batch``). Index helpers: per-epoch seeded global
batches (used by single-process references) and contiguous validation shards.
The per-worker training shards themselves live in :mod:`worker.engine.split`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import overload

import torch
from torch import Tensor
from typing_extensions import override


class Batches(Sequence[Tensor]):
    """Consecutive batches of one index tensor, made on demand: batch ``k`` is the next
    ``counts[k]`` indices of ``flat`` (a view), plus ``shift``.

    A worker's plan for the rest of an epoch (tens of thousands of steps on a large
    dataset) is thus one tensor and a list of counts, not a tensor per step.
    """

    def __init__(self, flat: Tensor, counts: Sequence[int], shift: int = 0) -> None:
        self.flat, self.counts, self.shift = flat, list(counts), shift
        self.starts = [0]
        for count in self.counts[:-1]:
            self.starts.append(self.starts[-1] + count)

    @override
    def __len__(self) -> int:
        return len(self.counts)

    @overload
    def __getitem__(self, k: int) -> Tensor: ...

    @overload
    def __getitem__(self, k: slice) -> Sequence[Tensor]: ...

    @override
    def __getitem__(self, k: int | slice) -> Tensor | Sequence[Tensor]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        batch = self.flat[self.starts[k] : self.starts[k] + self.counts[k]]
        return batch + self.shift if self.shift else batch

    def shifted(self, shift: int) -> Batches:
        """The same batches with ``shift`` added to every index."""
        return Batches(self.flat, self.counts, self.shift + shift)


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


def apportion(total: int, weights: list[float]) -> list[int]:
    """Split ``total`` into integers proportional to ``weights`` that sum exactly to ``total``.

    Largest-remainder method (Hamilton): floors first, then one more to the
    largest fractional parts, ties to the lower index. Raises ValueError if
    ``weights`` is empty, has a negative or non-finite value, or sums to 0
    while ``total > 0``.
    """
    if not weights or any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"weights must be finite and >= 0, got {weights}")
    weight_sum = sum(weights)
    if weight_sum <= 0:
        if total > 0:
            raise ValueError("weights sum to 0")
        return [0] * len(weights)
    exact = [total * w / weight_sum for w in weights]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def weighted_shares(total: int, weights: list[float], minimum: int = 1) -> list[int]:
    """Like :func:`apportion`, but every share is at least ``minimum`` (when ``total`` allows).

    Shares below ``minimum`` are raised by taking from the largest share;
    keeping every worker at >= 1 sample keeps its throughput measurable.
    Raises ValueError as :func:`apportion`.
    """
    counts = apportion(total, weights)
    if total < minimum * len(weights):
        return counts
    for i in range(len(counts)):
        while counts[i] < minimum:
            counts[counts.index(max(counts))] -= 1
            counts[i] += 1
    return counts


def capped_shares(
    total: int, weights: list[float], caps: list[int | None], minimum: int = 1
) -> list[int]:
    """Like :func:`weighted_shares`, but no share above its cap (``caps[i]``; None: no cap).

    Water-filling: the shares are made as :func:`weighted_shares` makes them (largest
    remainder, each at least ``minimum`` where the total allows); every worker whose share
    exceeds its cap is set to its cap, and what is left is shared by the others in proportion
    to their weights the same way, until no share exceeds its cap. Shares sum exactly to
    ``total``; a worker held at a cap below ``minimum`` keeps its cap. Where the uncapped
    workers left all have weight 0, they share what is left evenly. Without caps (all None)
    it returns exactly what :func:`weighted_shares` does.

    Raises ValueError naming the numbers when the caps (all set) sum to less than ``total``,
    when a cap is negative or ``caps`` is not one per weight, and as :func:`weighted_shares`.
    """
    if len(caps) != len(weights):
        raise ValueError(f"{len(caps)} caps for {len(weights)} weights")
    if all(cap is None for cap in caps):
        return weighted_shares(total, weights, minimum)
    if any(cap is not None and cap < 0 for cap in caps):
        raise ValueError(f"caps must be >= 0 or None, got {caps}")
    if all(cap is not None for cap in caps):
        room = sum(cap for cap in caps if cap is not None)
        if room < total:
            raise ValueError(f"caps {caps} hold {room} samples, fewer than the {total} to share")
    held: dict[int, int] = {}  # worker -> its cap, for the workers held at it
    while True:
        free = [i for i in range(len(weights)) if i not in held]
        rest = total - sum(held.values())
        free_weights = [float(weights[i]) for i in free]
        if rest > 0 and sum(free_weights) <= 0:
            free_weights = [1.0] * len(free)
        counts = weighted_shares(rest, free_weights, minimum)
        over = {
            i: cap
            for i, count in zip(free, counts, strict=True)
            if (cap := caps[i]) is not None and count > cap
        }
        if not over:
            break
        held.update(over)
    out = [0] * len(weights)
    for i, cap in held.items():
        out[i] = cap
    for i, count in zip(free, counts, strict=True):
        out[i] = count
    return out


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


def contiguous_shard(
    n_items: int, n_workers: int, worker_index: int, weights: list[float] | None = None
) -> range:
    """Item indices of worker ``worker_index`` in a contiguous split of ``range(n_items)``.

    Even without ``weights`` (sizes differ by at most 1); with them, sizes proportional to
    ``weights`` (one per worker, e.g. the batch shares, so that a worker at a third of the
    speed takes a third of the items: :func:`apportion`, whose errors it raises; a worker of
    weight 0 takes none).
    """
    if weights is not None and len(weights) != n_workers:
        raise ValueError(f"{len(weights)} weights for {n_workers} workers")
    shares = even_shares(n_items, n_workers) if weights is None else apportion(n_items, weights)
    start = sum(shares[:worker_index])
    return range(start, start + shares[worker_index])
