"""The data path: every compute worker reads only the items of its shard (docs/architecture.md).

Each compute worker calls the user's ``build_datasets`` itself (seeded, lazily: the
contract does not change) and sees it through the task's preprocessing stages
(:class:`worker.engine.preprocess.Prepared`). Dataset-level statistics (normalize's
mean and standard deviation, the tokenizer's vocabulary) are computed once, shared over
the workers (:class:`WorldFitter`), and shipped instead of the data. The parameter server
never builds or reads training data: it learns the item count and keeps the split state
(:mod:`worker.engine.split`) like every rank.

Two ways to read, chosen per task (:class:`contracts.data.DataOptions`, ``auto`` by
default, the choice logged):

- **streaming** (:class:`Stream`): a ``torch.utils.data.DataLoader`` over the prepared
  training and validation sets, whose batch sampler yields exactly the indices the split
  assigns this worker, step by step (:meth:`worker.engine.split.SplitState.upcoming`), so
  the loader processes read and preprocess ahead of the step that needs them, and read
  nothing outside the shard. When the split changes (rebalancing, the neighbour exchange,
  a new epoch) the batch read ahead no longer matches and the worker plans again from
  the new assignment;
- **memory** (:class:`TensorData`): the worker reads and preprocesses every item once
  and keeps them stacked; a step indexes tensors. Fastest for small in-memory datasets
  (a ``TensorDataset`` without preprocessing is used as is, without a copy).

Both give a step the same batch: ``default_collate`` of the prepared items in the
split's order, so a step is the same on either path to the bit.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate
from typing_extensions import override

from contracts.data import MEMORY_PATH_MAX_BYTES, DataOptions
from contracts.preprocess import Augment, PreprocessStep, Tokenize
from worker.engine import report
from worker.engine.contract import ContractError, TrainingCode, seed_everything
from worker.engine.distributed import Topology, all_gather_objects, broadcast_object
from worker.engine.exchange import sum_over_world
from worker.engine.preprocess import (
    Fitter,
    Prepared,
    build_stages,
    bytes_of,
    stack_images,
    stats_from_sums,
    summed_channels,
    texts_of,
    train_tokenizer,
)
from worker.engine.sharding import Batches, contiguous_shard

#: Items per batch when a worker reads its part of the training set for a statistic.
STATS_BATCH = 256


class Source(Protocol):
    """Where a worker's steps read their batches: :class:`TensorData` or a :class:`StreamView`."""

    def __len__(self) -> int: ...

    def take(self, indices: Tensor | Sequence[int]) -> Any:
        """The collated batch of items ``indices`` (int64 ``[b]``, ``b >= 1``)."""
        ...

    def expects(self, indices: Tensor) -> bool:
        """Whether ``indices`` are the next batch planned (always True without a plan)."""
        ...

    def plan(self, batches: Sequence[Tensor]) -> None:
        """The batches :meth:`take` will be asked for next, in order (empty ones skipped)."""
        ...


@dataclass
class TensorData:
    """A dataset stacked into tensors: ``leaves[k]`` is ``[N, ...]``, ``spec`` the item structure.

    ``take(indices)`` returns a batch shaped like ``default_collate`` of those
    items, e.g. ``(inputs [b, ...], targets [b])``.
    """

    leaves: list[Tensor]
    spec: pytree.TreeSpec

    def __len__(self) -> int:
        return int(self.leaves[0].shape[0]) if self.leaves else 0

    def take(self, indices: Tensor | Sequence[int]) -> Any:
        """The batch of items ``indices`` (int64 ``[b]``), structured like one collated batch."""
        index = torch.as_tensor(indices, dtype=torch.int64)
        return pytree.tree_unflatten([leaf[index] for leaf in self.leaves], self.spec)

    def expects(self, indices: Tensor) -> bool:
        """Always True: every item is at hand."""
        return True

    def plan(self, batches: Sequence[Tensor]) -> None:
        """Nothing to read ahead."""

    @classmethod
    def from_batch(cls, batch: Any) -> TensorData:
        """Wrap one collated batch of all items (e.g. ``(inputs [N, ...], targets [N])``)."""
        leaves, spec = pytree.tree_flatten(batch)
        if not leaves or not all(isinstance(leaf, Tensor) for leaf in leaves):
            raise ValueError("dataset items must collate to tensors (tokenize text first)")
        if len({int(leaf.shape[0]) for leaf in leaves}) != 1:
            raise ValueError("every part of a collated batch must have the same length")
        return cls(leaves, spec)


def stack_dataset(dataset: Any) -> TensorData:
    """All items of ``dataset`` as one :class:`TensorData` (TensorDatasets without copying).

    A :class:`Prepared` dataset without stages over a TensorDataset is not copied either.
    An empty dataset gives an empty TensorData. Raises ValueError if the items do not
    collate to tensors (:func:`collate`).
    """
    if isinstance(dataset, Prepared) and not dataset.stages:
        dataset = dataset.base
    if isinstance(dataset, TensorDataset):
        return TensorData.from_batch(tuple(dataset.tensors))
    items = [dataset[i] for i in range(len(dataset))]
    if not items:
        return TensorData([], pytree.tree_flatten(())[1])
    return TensorData.from_batch(collate(items))


@dataclass
class Collated:
    """A batch read whole (``_Joined.__getitems__``), which :func:`collate` passes through."""

    batch: Any


class _Joined(Dataset):
    """The training items followed by the validation items: one loader reads both.

    A batch of a :class:`Prepared` set without stages over a ``TensorDataset`` is read
    with one index per tensor (``__getitems__``), as ``default_collate`` of its items
    would stack it, instead of item by item.
    """

    def __init__(self, train: Dataset, val: Dataset) -> None:
        self.train, self.val, self.split = train, val, len(train)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self.split + len(self.val)  # type: ignore[arg-type]

    @override
    def __getitem__(self, index: int) -> Any:
        return self.train[index] if index < self.split else self.val[index - self.split]

    def __getitems__(self, indices: list[int]) -> Any:
        """Items ``indices`` (all of one part: planned batches never mix the two)."""
        part, offset = (self.train, 0) if indices[0] < self.split else (self.val, self.split)
        base = part.base if isinstance(part, Prepared) and not part.stages else None
        if isinstance(base, TensorDataset):
            index = torch.as_tensor(indices, dtype=torch.int64) - offset
            return Collated([tensor[index] for tensor in base.tensors])
        return [part[i - offset] for i in indices]


class _Planned:
    """A DataLoader batch sampler whose batches (index tensors, from ``start`` on, empty ones
    skipped) are set from outside before each iteration; each becomes a list only when the
    loader asks for it."""

    def __init__(self) -> None:
        self.batches: Sequence[Tensor] = []
        self.start = 0

    def __iter__(self) -> Iterator[list[int]]:
        batches, start = self.batches, self.start
        return (b.tolist() for k in range(start, len(batches)) if len(b := batches[k]))

    def __len__(self) -> int:
        return len(self.batches) - self.start


class Stream:
    """One DataLoader over a worker's prepared (training, validation) items, reading planned
    batches ahead in ``num_workers`` processes (0: in this process, nothing ahead).

    ``replans`` counts the plans started; ``direct`` the batches read without a plan.
    """

    def __init__(
        self, train: Dataset, val: Dataset, options: DataOptions, device: Any, seed: int = 0
    ) -> None:
        self.joined = _Joined(train, val)
        self.sampler = _Planned()
        in_memory = all(_tensors_only(part) for part in (train, val))
        workers = loader_workers(options, device, in_memory=in_memory)
        cuda = torch.device(device).type == "cuda"
        self.loader = DataLoader(
            self.joined,
            # Its own generator: a new iteration (every plan) would otherwise draw its seed
            # from the global one, and the model's dropout would depend on the data path.
            generator=torch.Generator().manual_seed(seed),
            batch_sampler=self.sampler,
            num_workers=workers,
            prefetch_factor=options.prefetch_factor if workers else None,
            persistent_workers=options.persistent_workers and workers > 0,
            pin_memory=options.pin_memory if options.pin_memory is not None else cuda,
            collate_fn=collate,
        )
        self.batches: Sequence[Tensor] = []
        self.cursor = 0  # the next planned batch the steps will ask for
        self.iterator: Iterator[Any] | None = None
        self.replans = self.direct = 0
        if self.loader.persistent_workers:
            # Start the loader processes now, before the split's index tensors exist: a
            # process forked later would keep a copy-on-write share of them for good.
            iter(self.loader)

    def plan(self, batches: Sequence[Tensor]) -> None:
        """Start reading ``batches`` (global indices into the joined set) ahead."""
        self.batches, self.cursor = batches, 0
        self._skip_empty()
        self.sampler.batches, self.sampler.start = batches, self.cursor
        self.iterator = iter(self.loader) if self.cursor < len(batches) else None
        self.replans += 1

    def _skip_empty(self) -> None:
        while self.cursor < len(self.batches) and not len(self.batches[self.cursor]):
            self.cursor += 1

    def expects(self, indices: Tensor) -> bool:
        return self.cursor < len(self.batches) and torch.equal(self.batches[self.cursor], indices)

    def take(self, indices: Tensor) -> Any:
        """The batch of ``indices``: the next planned one when it matches, else read here."""
        if self.iterator is not None and self.expects(indices):
            self.cursor += 1
            self._skip_empty()
            return next(self.iterator)
        self.direct += 1
        return collate([self.joined[int(i)] for i in indices])


@dataclass
class StreamView:
    """The training (``offset`` 0) or validation part of a :class:`Stream`."""

    stream: Stream
    offset: int
    length: int

    def __len__(self) -> int:
        return self.length

    def take(self, indices: Tensor | Sequence[int]) -> Any:
        return self.stream.take(torch.as_tensor(indices, dtype=torch.int64) + self.offset)

    def expects(self, indices: Tensor) -> bool:
        return self.stream.expects(indices + self.offset if self.offset else indices)

    def plan(self, batches: Sequence[Tensor]) -> None:
        if self.offset and isinstance(batches, Batches):
            batches = batches.shifted(self.offset)
        elif self.offset:
            batches = [torch.as_tensor(b) + self.offset for b in batches]
        self.stream.plan(batches)


def _tensors_only(dataset: Any) -> bool:
    """True for a :class:`Prepared` set without stages over a ``TensorDataset``."""
    return (
        isinstance(dataset, Prepared)
        and not dataset.stages
        and isinstance(dataset.base, TensorDataset)
    )


def loader_workers(options: DataOptions, device: Any, *, in_memory: bool = False) -> int:
    """DataLoader processes of one compute worker: ``options.num_workers``; by default 0 for
    ``in_memory`` data (TensorDatasets without preprocessing: a batch is one index per
    tensor, nothing to read or decode ahead, so a loader process would only add a copy
    between processes), else 1 on CPU and 2 on CUDA. Raises ValueError naming the field
    when it exceeds this host's cores."""
    cores = os.cpu_count() or 1
    if options.num_workers is not None and options.num_workers > cores:
        raise ValueError(
            f"data.num_workers is {options.num_workers} but this host has {cores} cores: "
            f"ask for at most {cores}"
        )
    if options.num_workers is not None:
        return options.num_workers
    if in_memory:
        return 0
    return 2 if torch.device(device).type == "cuda" else 1


class WorldFitter(Fitter):
    """Dataset-level statistics computed once for the whole task (every rank calls each
    method in the same order; the parameter server passes no data and receives the result).

    The tokenizer is trained by the first compute worker on every training text and sent
    to all ranks as JSON; channel statistics are summed over every compute worker's
    contiguous part of the training set (float64, one sum over the task), read in
    :data:`STATS_BATCH` batches through a DataLoader.
    """

    def __init__(self, topo: Topology, options: DataOptions) -> None:
        self.topo, self.options = topo, options

    @override
    def vocabulary(self, step: Tokenize, train: Any) -> str:
        built = None
        if self.topo.rank == 1:
            built = train_tokenizer(step, texts_of(train, range(len(train))))
        return str(broadcast_object(built, self.topo, src=1))

    @override
    def channel_stats(self, prefix: Prepared | None) -> tuple[Tensor, Tensor]:
        totals: dict[str, tuple[float, float]] = {}
        if prefix is not None and not self.topo.is_ps:
            part = contiguous_shard(len(prefix), self.topo.n_workers, self.topo.worker_index)
            sums = self._sums(prefix, list(part))
            for c in range(sums.shape[1]):
                totals[f"{c:06d}:sum"] = (float(sums[1, c]), float(sums[0, c]))
                totals[f"{c:06d}:squares"] = (float(sums[2, c]), float(sums[0, c]))
        summed = sum_over_world(totals, self.topo)
        channels = len(summed) // 2
        if channels == 0:
            raise ValueError("normalize: the training set has no images to compute mean/std")
        table = torch.zeros(3, channels, dtype=torch.float64)
        for c in range(channels):
            table[1, c], table[0, c] = summed[f"{c:06d}:sum"]
            table[2, c] = summed[f"{c:06d}:squares"][0]
        return stats_from_sums(table)

    def _sums(self, prefix: Prepared, indices: list[int]) -> Tensor:
        batches = [indices[i : i + STATS_BATCH] for i in range(0, len(indices), STATS_BATCH)]
        workers = loader_workers(self.options, "cpu")
        loader = DataLoader(
            prefix,
            generator=torch.Generator().manual_seed(0),  # leaves the global generator alone
            batch_sampler=batches,
            num_workers=workers,
            collate_fn=stack_images,
        )
        return summed_channels(loader)


@dataclass
class DataSources:
    """What :func:`prepare_data` gives a rank: the item counts, and on compute workers the
    training and validation sources."""

    n_train: int
    n_val: int
    train: Source | None
    val: Source | None


def check_map_style(dataset: Any, which: str) -> None:
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        raise ContractError(
            f"build_datasets returned an iterable {which} dataset ({type(dataset).__name__}): "
            "polytrain gives every worker the indices of its shard, so both datasets must be "
            "map-style (define __len__ and __getitem__)"
        )
    try:
        len(dataset)
    except TypeError as exc:
        raise ContractError(f"the {which} dataset has no length: define __len__") from exc


def collate(items: list[Any] | Collated) -> Any:
    """``default_collate`` of ``items``, refusing items that do not make a batch of tensors.

    Raises ValueError describing the first item (e.g. ``(Tensor(3,) torch.float32, int)``)
    and what to return instead. A :class:`Collated` batch is returned as it is.
    """
    if isinstance(items, Collated):
        return items.batch
    try:
        batch = default_collate(items)
    except (TypeError, RuntimeError, ValueError) as exc:
        raise ValueError(
            f"dataset items do not collate into a batch ({exc}); item 0 of the batch is "
            f"{_describe(items[0])}: return tensors or numbers of one shape per part "
            "(text needs a tokenize preprocessing step)"
        ) from exc
    leaves = pytree.tree_leaves(batch)
    if not leaves or not all(isinstance(leaf, Tensor) for leaf in leaves):
        raise ValueError(
            f"dataset items do not collate into tensors; item 0 of the batch is "
            f"{_describe(items[0])} (text needs a tokenize preprocessing step)"
        )
    return batch


def _describe(item: Any) -> str:
    if isinstance(item, Tensor):
        return f"Tensor{tuple(item.shape)} {item.dtype}"
    if isinstance(item, tuple | list):
        return "(" + ", ".join(_describe(part) for part in item) + ")"
    return type(item).__name__


def choose_path(
    options: DataOptions, train: Any, val: Any, steps: list[PreprocessStep]
) -> tuple[str, str]:
    """``(memory or streaming, why)``; ``auto``: memory for TensorDatasets of at most
    :data:`contracts.data.MEMORY_PATH_MAX_BYTES` together, counting augmented copies."""
    if options.path != "auto":
        return options.path, "set by the task's data.path"
    grown = math.prod(step.copies + 1 for step in steps if isinstance(step, Augment))
    size = bytes_of(train) * grown + bytes_of(val)  # what the memory path would stack
    if not math.isfinite(size):
        return "streaming", "auto: the datasets are not in-memory TensorDatasets"
    path = "memory" if size <= MEMORY_PATH_MAX_BYTES else "streaming"
    limit = MEMORY_PATH_MAX_BYTES >> 20
    return path, f"auto: TensorDatasets of {size / 2**20:.1f} MiB, limit {limit} MiB"


def agreed_counts(topo: Topology, mine: tuple[int, int, str] | None) -> tuple[int, int, str]:
    """Every worker's ``(training items, validation items, path)`` on every rank
    (:func:`worker.engine.distributed.all_gather_objects`; the parameter server passes
    None): the workers' must agree.

    Raises ContractError on every rank when they differ, naming each worker's counts:
    the ranks would otherwise run different numbers of steps and wait on each other
    until the distributed timeout (e.g. a datasets folder that differs between hosts).
    """
    gathered = all_gather_objects(mine, topo)
    counts = {rank: tuple(c) for rank, c in enumerate(gathered) if c is not None}
    if len({c[:2] for c in counts.values()}) != 1:
        listed = ", ".join(f"rank {r}: {c[0]} + {c[1]}" for r, c in sorted(counts.items()))
        raise ContractError(
            "the compute workers built datasets of different sizes (training + validation "
            f"items: {listed}): build_datasets must give every worker the same items; check "
            "that the datasets folder (POLYTRAIN_DATASETS_DIR of each agent) holds the same "
            "files on every host"
        )
    first = counts[min(counts)]
    return int(first[0]), int(first[1]), str(first[2])


def prepare_data(
    code: TrainingCode,
    topo: Topology,
    steps: list[PreprocessStep],
    options: DataOptions,
    seed: int,
) -> DataSources:
    """The data stage of every rank (collectives in the same order on each).

    Compute workers build the user's datasets (global generators seeded with ``seed``
    first), fit the preprocessing statistics together and open their source; the
    parameter server only takes part in the statistics and learns the item counts.
    Raises ContractError for a dataset that is not map-style, ValueError for
    ``num_workers`` beyond the host's cores (items that do not collate raise ValueError
    when the first batch is read, :func:`collate`), PreprocessError for a step
    that does not fit, and whatever ``build_datasets`` raises.
    """
    train = val = None
    if not topo.is_ps:
        seed_everything(seed)
        train, val = code.build_datasets()
        check_map_style(train, "training")
        check_map_style(val, "validation")
    fitter = WorldFitter(topo, options)
    train_stages, val_stages = build_stages(steps, train, seed, fitter)
    if topo.is_ps:
        counts = agreed_counts(topo, None)
        report.log(
            f"data: {counts[0]} training and {counts[1]} validation items after "
            f"{len(steps)} preprocessing step(s), {counts[2]} path on the workers"
        )
        return DataSources(counts[0], counts[1], None, None)
    prepared = Prepared(train, train_stages), Prepared(val, val_stages)
    path, why = choose_path(options, train, val, steps)
    agreed_counts(topo, (len(prepared[0]), len(prepared[1]), path))
    sources: tuple[Source, Source]
    if path == "memory":
        sources = stack_dataset(prepared[0]), stack_dataset(prepared[1])
    else:
        stream = Stream(prepared[0], prepared[1], options, topo.device, seed)
        sources = (
            StreamView(stream, 0, len(prepared[0])),
            StreamView(stream, len(prepared[0]), len(prepared[1])),
        )
    if topo.rank == 1:
        report.log(f"data path: {path} ({why})")
    return DataSources(len(prepared[0]), len(prepared[1]), sources[0], sources[1])
