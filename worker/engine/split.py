"""Which training samples each compute worker holds and takes: the split state.

Every worker owns a *shard* (indices into the preprocessed training set).
Shard sizes follow the per-worker batch *shares* (samples per optimizer step,
summing to the global batch size B), so that every worker runs out of data on
the same step: an epoch has ``T = ceil(N / B)`` steps for every worker, step
``t < T - 1`` takes ``shares[i]`` samples from worker ``i`` and the last step
splits the remainder ``N - (T - 1) B`` in proportion to the shares.

The state is a pure function of the seed, the epoch and the share decisions,
so every rank (the parameter server included, which checkpoints it) keeps an
identical copy without sending indices around; only share changes are
broadcast. Changing shares mid-epoch moves the surplus of not-yet-used samples
from the workers that now need fewer to those that need more. After each
epoch, :meth:`SplitState.exchange` passes a random fraction of every worker's
shard to its ring neighbour (worker ``i`` to ``(i + 1) % W``), the neighbour
exchange of the heterogeneous-computing patent family this design follows.

The state also remembers which samples moved: ``rebalanced_in[i]`` those moved to worker
``i`` this epoch to fit the shares (a mid-epoch share change, or the resizing at the epoch's
start), ``exchanged_in[i]`` those it received at the last exchange
(the shard provenance of :mod:`worker.engine.provenance` counts them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from worker.engine.sharding import Batches, apportion, even_shares, steps_per_epoch


def index_dtype(n_items: int) -> torch.dtype:
    """int32 for item indices below 2**31 (half the memory of int64: every rank holds every
    worker's shard), else int64. The permutations are the same in either."""
    return torch.int32 if n_items < 2**31 else torch.int64


def _generator(*parts: int) -> torch.Generator:
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + part) % (2**62)
    return torch.Generator().manual_seed(seed)


@dataclass
class SplitState:
    """Shards, shares and the data position within the current epoch.

    ``shards[i]`` (``[n_i]``, :func:`index_dtype`) is worker ``i``'s shard in the order it is
    consumed this epoch; ``used[i]`` how many it has taken; ``step`` the
    optimizer steps done this epoch (``0 .. steps_per_epoch``). ``rebalanced_in[i]`` holds the
    samples moved to worker ``i`` this epoch to fit the shares, ``exchanged_in[i]`` those it
    received from its neighbour at the last exchange (empty lists: none).
    """

    n_items: int
    batch: int
    shares: list[int]
    shards: list[Tensor]
    used: list[int]
    step: int = 0
    rebalanced_in: list[Tensor] = field(default_factory=list)
    exchanged_in: list[Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        empty = torch.empty(0, dtype=index_dtype(self.n_items))
        self.rebalanced_in = self.rebalanced_in or [empty] * len(self.shares)
        self.exchanged_in = self.exchanged_in or [empty] * len(self.shares)

    @classmethod
    def initial(cls, n_items: int, shares: list[int], seed: int) -> SplitState:
        """Contiguous blocks of one seeded permutation, sized for ``shares`` (before epoch 0).

        Raises ValueError if the shares do not sum to a positive batch size.
        """
        batch = sum(shares)
        if batch < 1 or min(shares) < 0:
            raise ValueError(f"bad shares {shares}")
        order = torch.randperm(n_items, generator=_generator(seed, 7), dtype=index_dtype(n_items))
        state = cls(n_items, batch, list(shares), [], [0] * len(shares))
        sizes = state.needs_from(0)
        bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
        state.shards = [order[bounds[i] : bounds[i + 1]] for i in range(len(shares))]
        return state

    def first_shard(self, worker: int, n_workers: int, seed: int) -> Tensor:
        """Worker ``worker``'s shard under :meth:`initial` with even shares of this
        state's batch: the items it profiles on before the shares are chosen."""
        even = SplitState.initial(self.n_items, even_shares(self.batch, n_workers), seed)
        return even.shards[worker]

    @property
    def n_workers(self) -> int:
        """Number of compute workers."""
        return len(self.shares)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in every epoch (the last, partial batch counts)."""
        return steps_per_epoch(self.n_items, self.batch)

    @property
    def epoch_done(self) -> bool:
        """True once every step of the current epoch has been taken."""
        return self.step >= self.steps_per_epoch

    def counts(self, step: int) -> list[int]:
        """Samples each worker takes at in-epoch ``step``; they sum to B (less on the last step)."""
        last = self.steps_per_epoch - 1
        if step < last:
            return list(self.shares)
        return apportion(self.n_items - last * self.batch, [float(s) for s in self.shares])

    def needs_from(self, step: int) -> list[int]:
        """Samples each worker still takes from in-epoch ``step`` to the epoch's end."""
        full = max(0, self.steps_per_epoch - 1 - step)
        last = self.counts(self.steps_per_epoch - 1) if step < self.steps_per_epoch else []
        return [full * s + (last[i] if last else 0) for i, s in enumerate(self.shares)]

    def take(self, worker: int) -> Tensor:
        """Indices (``[counts(step)[worker]]``) worker ``worker`` trains on this step."""
        start = self.used[worker]
        return self.shards[worker][start : start + self.counts(self.step)[worker]]

    def upcoming(self, worker: int) -> Batches:
        """Worker ``worker``'s indices for every remaining step of the epoch, from this one
        on, as the current shares assign them (a share change reassigns them)."""
        last = self.steps_per_epoch - 1
        counts = [self.shares[worker]] * max(0, last - self.step)
        if self.step <= last:
            counts.append(self.counts(last)[worker])
        return Batches(self.shards[worker][self.used[worker] :], counts)

    def global_batch(self) -> Tensor:
        """All workers' indices of this step, in worker order: the step's global batch."""
        return torch.cat([self.take(i) for i in range(self.n_workers)])

    def advance(self) -> None:
        """Mark the current step as taken by every worker."""
        for i, count in enumerate(self.counts(self.step)):
            self.used[i] += count
        self.step += 1

    def set_shares(self, shares: list[int]) -> None:
        """Adopt new per-step ``shares`` (same sum) from the current step on.

        Not-yet-used samples move from the tails of workers that now need fewer
        to workers that need more, in worker order. Raises ValueError if the
        shares change the global batch size or the worker count.
        """
        if len(shares) != self.n_workers or sum(shares) != self.batch:
            raise ValueError(f"shares {shares} must be {self.n_workers} values summing to B")
        self.shares = list(shares)
        self._redistribute(self.needs_from(self.step))

    def _redistribute(self, needs: list[int]) -> None:
        if all(len(s) - u == n for s, u, n in zip(self.shards, self.used, needs, strict=True)):
            return  # every worker holds what it needs: nothing moves, nothing is copied
        remaining = [s[u:] for s, u in zip(self.shards, self.used, strict=True)]
        surplus = []
        for i, need in enumerate(needs):
            surplus.append(remaining[i][need:])
            remaining[i] = remaining[i][:need]
        pool = torch.cat(surplus)
        for i, need in enumerate(needs):
            lack = need - len(remaining[i])
            if lack > 0:
                self.rebalanced_in[i] = torch.cat([self.rebalanced_in[i], pool[:lack]])
            remaining[i], pool = torch.cat([remaining[i], pool[:lack]]), pool[lack:]
        parts = zip(self.shards, self.used, remaining, strict=True)
        self.shards = [torch.cat([s[:u], r]) for s, u, r in parts]

    def begin_epoch(self, seed: int, epoch: int) -> None:
        """Resize shards to the current shares and shuffle each one for ``epoch``."""
        self.used = [0] * self.n_workers
        self.step = 0
        self.rebalanced_in = [torch.empty(0, dtype=index_dtype(self.n_items))] * self.n_workers
        self._redistribute(self.needs_from(0))
        self.shards = [
            shard[
                torch.randperm(
                    len(shard),
                    generator=_generator(seed, epoch, i, 1),
                    dtype=index_dtype(len(shard)),
                )
            ]
            for i, shard in enumerate(self.shards)
        ]

    def exchange(self, fraction: float, seed: int, epoch: int) -> list[int]:
        """Pass ``round(fraction * n_i)`` random samples of each shard to the ring neighbour.

        Worker ``i`` sends to ``(i + 1) % W``; received samples join the end of
        the shard. Call after the epoch's last step. Returns the counts sent.
        """
        if self.n_workers < 2 or fraction <= 0:
            return [0] * self.n_workers
        kept, sent = [], []
        for i, shard in enumerate(self.shards):
            k = math.floor(fraction * len(shard) + 0.5)
            chosen = torch.zeros(len(shard), dtype=torch.bool)
            chosen[torch.randperm(len(shard), generator=_generator(seed, epoch, i, 2))[:k]] = True
            kept.append(shard[~chosen])
            sent.append(shard[chosen])
        self.shards = [torch.cat([kept[i], sent[i - 1]]) for i in range(self.n_workers)]
        self.exchanged_in = [sent[i - 1] for i in range(self.n_workers)]
        return [len(s) for s in sent]

    def regrouped(self, shares: list[int]) -> SplitState:
        """This epoch's position on another set of workers, with per-step ``shares`` (the same
        global batch): the samples not yet taken, pooled in worker order, are split for
        the new shares from the current step on; the samples already taken stay taken (split
        over the new workers in proportion to the shares, as the already-used heads of their
        shards, so the next epoch starts from every sample), so the epoch goes on where it
        stopped and every sample is still used once in it. Samples marked as moved are not
        carried over (the new workers start unmoved).

        Raises ValueError if the shares change the global batch size.
        """
        if sum(shares) != self.batch or min(shares, default=0) < 0:
            raise ValueError(f"shares {shares} must be non-negative and sum to B={self.batch}")
        parts = list(zip(self.shards, self.used, strict=True))
        taken = torch.cat([s[:u] for s, u in parts])
        remaining = torch.cat([s[u:] for s, u in parts])
        state = SplitState(self.n_items, self.batch, list(shares), [], [0] * len(shares))
        state.step = self.step
        needs = state.needs_from(self.step)
        if sum(needs) != len(remaining):  # cannot happen for a state this class wrote
            raise ValueError(f"{len(remaining)} samples left, the steps left take {sum(needs)}")
        heads = apportion(len(taken), [float(s) for s in shares])
        head_bounds = [0, *torch.tensor(heads).cumsum(0).tolist()]
        bounds = [0, *torch.tensor(needs).cumsum(0).tolist()]
        state.shards = [
            torch.cat(
                [taken[head_bounds[i] : head_bounds[i + 1]], remaining[bounds[i] : bounds[i + 1]]]
            )
            for i in range(len(shares))
        ]
        state.used = heads
        return state

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (for checkpoints; tensors and ints only)."""
        return {
            "n_items": self.n_items,
            "batch": self.batch,
            "shares": list(self.shares),
            "shards": [s.clone() for s in self.shards],
            "used": list(self.used),
            "step": self.step,
            "rebalanced_in": [t.clone() for t in self.rebalanced_in],
            "exchanged_in": [t.clone() for t in self.exchanged_in],
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> SplitState:
        """Rebuild a state written by :meth:`state_dict` (one from before the moved samples
        were kept resumes with none marked as moved)."""
        return cls(
            n_items=int(state["n_items"]),
            batch=int(state["batch"]),
            shares=[int(s) for s in state["shares"]],
            shards=[s.clone() for s in state["shards"]],
            used=[int(u) for u in state["used"]],
            step=int(state["step"]),
            rebalanced_in=[t.clone() for t in state.get("rebalanced_in", [])],
            exchanged_in=[t.clone() for t in state.get("exchanged_in", [])],
        )
