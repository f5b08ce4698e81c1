"""Shard provenance: which compute worker trained which training samples, per epoch and attempt.

The parameter server holds the same split state as every worker
(:mod:`worker.engine.split`), so it knows every worker's index set without a message. It
keeps a :class:`ShardLedger` and closes a *segment* at every checkpoint inside an epoch and
at the epoch's end, before the neighbour exchange: for every worker, the samples it took since
the last segment (``shards[i][start_i:used_i]``, which a share change never moves, because a
rebalance moves only samples not yet taken). The segments go out with the checkpoint they
belong to (the ``provenance`` of its ``checkpoint`` event), so the samples recorded are those
whose updates that checkpoint holds: work after the last checkpoint of a failed attempt is not
recorded, and the attempt that resumes from it redoes and records it. A record::

    {"worker": int, "rank": int, "group_index": int, "group": str, "epoch": int,
     "step_from": int, "step_to": int, "samples": int, "index_hash": str (16 hex digits),
     "rebalanced": int, "exchanged": int}

``step_from`` .. ``step_to`` are global optimizer steps (the segment's samples were taken in
steps ``step_from + 1 .. step_to``). ``rebalanced`` counts the segment's samples that were
moved to this worker this epoch to fit the shares (a rebalance mid-epoch, or the resizing at
the epoch's start after an exchange or an epoch-end rebalance), ``exchanged`` those it received
from its ring neighbour at the previous epoch's end.

``index_hash`` is an additive multiset hash of the index set (Clarke et al., "Incremental
Multiset Hash Functions and Their Application to Memory Integrity Checking", ASIACRYPT 2003):
``H(S) = sum over i in S of splitmix64(i) mod 2**64`` (SplitMix64: Steele, Lea and Flood,
"Fast Splittable Pseudorandom Number Generators", OOPSLA 2014). Hashes of disjoint sets add,
so an epoch's records cover the training set exactly once when their sample counts sum to
``n_items`` and their hashes sum (mod 2**64) to :func:`training_set_hash` of ``n_items``, which
the event carries as ``set_hash``; the backend checks this per epoch across attempts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
import torch

from worker.engine.spec import RunSpec
from worker.engine.split import SplitState

_MASK = (1 << 64) - 1
_CHUNK = 1 << 22  # items hashed at a time: bounds the temporary arrays to ~100 MB


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of ``values`` (uint64, wrapping arithmetic)."""
    z = values + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def index_hash(indices: torch.Tensor | np.ndarray) -> int:
    """The additive multiset hash (an int below 2**64) of ``indices`` (``[n]``, integer)."""
    flat = np.asarray(indices).astype(np.uint64, copy=False).ravel()
    total = 0
    with np.errstate(over="ignore"):
        for start in range(0, len(flat), _CHUNK):
            total += int(_splitmix64(flat[start : start + _CHUNK]).sum(dtype=np.uint64))
    return total & _MASK


@cache
def training_set_hash(n_items: int) -> int:
    """:func:`index_hash` of ``0 .. n_items - 1``: the whole training set once."""
    total = 0
    for start in range(0, n_items, _CHUNK):
        total += index_hash(np.arange(start, min(n_items, start + _CHUNK), dtype=np.uint64))
    return total & _MASK


def as_hex(value: int) -> str:
    """A hash as the 16 lower-case hex digits the records carry."""
    return f"{value:016x}"


@dataclass
class ShardLedger:
    """The parameter server's record of the segments not yet sent with a checkpoint."""

    spec: RunSpec
    start: list[int] = field(default_factory=list)
    start_step: int = 0
    pending: list[dict[str, Any]] = field(default_factory=list)

    def begin(self, split: SplitState, step: int) -> None:
        """Start counting at the split's current position (an epoch's start, or a resume)."""
        self.start, self.start_step = list(split.used), step

    def close(self, split: SplitState, *, epoch: int, step: int) -> None:
        """Record every worker's samples since the last segment; call before an exchange."""
        if not self.start:
            self.begin(split, self.start_step)
        for worker, (shard, begun, used) in enumerate(
            zip(split.shards, self.start, split.used, strict=True)
        ):
            taken = shard[begun:used]
            rank = worker + 1
            group = self.spec.group_of(rank)
            self.pending.append(
                {
                    "worker": worker,
                    "rank": rank,
                    "group_index": group,
                    "group": self.spec.groups[group].name,
                    "epoch": epoch,
                    "step_from": self.start_step,
                    "step_to": step,
                    "samples": len(taken),
                    "index_hash": as_hex(index_hash(taken)),
                    "rebalanced": _count_in(taken, split.rebalanced_in[worker]),
                    "exchanged": _count_in(taken, split.exchanged_in[worker]),
                }
            )
        self.begin(split, step)

    def drain(self, n_items: int) -> dict[str, Any]:
        """The ``provenance`` of the checkpoint being written: the pending segments, and the
        training set's size and hash to check them against; clears the pending list."""
        records, self.pending = self.pending, []
        return {
            "n_items": n_items,
            "set_hash": as_hex(training_set_hash(n_items)),
            "records": records,
        }


def _count_in(taken: torch.Tensor, marked: torch.Tensor) -> int:
    if not len(taken) or not len(marked):
        return 0
    return int(torch.isin(taken, marked).sum())
