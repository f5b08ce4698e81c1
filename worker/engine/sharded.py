"""Tensors that may be sharded over a group (DTensors, :mod:`worker.engine.fsdp`): this
worker's rows of one, or the whole of it. Tensors that are not sharded pass through, so the
engine's code reads the same for a sharded model and a whole one."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import Tensor
from torch.distributed.tensor import DTensor


def is_sharded(tensor: Tensor) -> bool:
    """True for a DTensor (a sharded parameter, its gradient or optimizer state)."""
    return isinstance(tensor, DTensor)


def local(tensor: Tensor) -> Tensor:
    """This worker's rows of a sharded tensor (the tensor itself when not sharded)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full(tensor: Tensor) -> Tensor:
    """The whole of a sharded tensor, gathered over its group (every member calls it alike);
    the tensor itself when not sharded."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def materialised(tensors: Iterable[Tensor]) -> Iterator[Tensor]:
    """Each tensor whole, one at a time (:func:`full`), so at most one parameter is gathered."""
    for tensor in tensors:
        yield full(tensor)
