"""The data distribution stage: preprocess once on the parameter server, send to every worker.

Rank 0 calls the user's ``build_datasets`` once, runs the task's
preprocessing steps (:mod:`worker.engine.preprocess`) once, and stacks every
item into tensors (:class:`TensorData`). It then broadcasts those tensors to
every worker over torch.distributed, so workers never build, preprocess or
load the data themselves and nothing assumes a shared file system. Each worker
holds the preprocessed set; its shard (:mod:`worker.engine.split`) is a set of
indices into it, so rebalancing and the neighbour exchange move assignments,
not bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils.data import TensorDataset, default_collate


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

    An empty dataset gives an empty TensorData. Raises ValueError if the items
    do not collate to tensors.
    """
    if isinstance(dataset, TensorDataset):
        return TensorData.from_batch(tuple(dataset.tensors))
    items = [dataset[i] for i in range(len(dataset))]
    if not items:
        return TensorData([], pytree.tree_flatten(())[1])
    try:
        return TensorData.from_batch(default_collate(items))
    except TypeError as exc:
        raise ValueError(f"dataset items do not stack into tensors: {exc}") from exc


def _broadcast_tensor(tensor: Tensor | None, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """Broadcast one tensor from rank 0 over the world as raw bytes (any dtype, gloo-safe)."""
    if tensor is None:
        tensor = torch.empty(shape, dtype=dtype)
    raw = tensor.contiguous().reshape(-1).view(torch.uint8)
    if raw.numel():
        dist.broadcast(raw, src=0)
    return raw.view(dtype).reshape(shape)


def _spec_out(spec: pytree.TreeSpec) -> str | pytree.TreeSpec:
    """The structure as JSON where torch can serialise it (not, e.g., unregistered namedtuples)."""
    try:
        return pytree.treespec_dumps(spec)
    except (NotImplementedError, TypeError, ValueError):
        return spec


def _spec_in(sent: str | pytree.TreeSpec) -> pytree.TreeSpec:
    return pytree.treespec_loads(sent) if isinstance(sent, str) else sent


def share_data(data: TensorData | None) -> TensorData:
    """Rank 0 passes its :class:`TensorData`; every rank returns the same data.

    One ``broadcast_object_list`` carries the structure (as
    :func:`torch.utils._pytree.treespec_dumps` JSON: unpickling a TreeSpec
    raises a torch FutureWarning in every rank's log), shapes and dtypes, then
    one byte broadcast per tensor. Call on every rank of the world.
    """
    meta: list[Any] = [None]
    if dist.get_rank() == 0:
        if data is None:
            raise ValueError("rank 0 must pass the data")
        meta = [(_spec_out(data.spec), [(leaf.shape, leaf.dtype) for leaf in data.leaves])]
    dist.broadcast_object_list(meta, src=0)
    spec, layout = _spec_in(meta[0][0]), meta[0][1]
    mine = data.leaves if data is not None else [None] * len(layout)
    pairs = zip(mine, layout, strict=True)
    leaves = [_broadcast_tensor(t, shape, dtype) for t, (shape, dtype) in pairs]
    return TensorData(leaves, spec)
