"""Sharding inside a resource group: the model wrapped with torch's FSDP2 over the group.

With ``sharding: fsdp`` (the task's, or a group's own) every worker of the group holds 1/W
of each parameter, of its gradient and of the optimizer state (ZeRO stage 3: Rajbhandari
et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020;
torch's FSDP2, ``torch.distributed.fsdp.fully_shard`` on DTensor, Zhao et al., "PyTorch
FSDP", VLDB 2023). Each parameter becomes a DTensor sharded on its first dimension over
the group's device mesh (gloo on CPU, NCCL on CUDA: the group's own process group); a
*unit* (a submodule wrapped on its own) is gathered whole for its forward and backward
only, so at most a unit or two is unsharded at a time. Buffers are not sharded: every
member holds them (they travel with the step as without sharding, docs/heterogeneity.md,
"Buffers").

The engine keeps its exact sums (docs/heterogeneity.md, "Sharding inside a group"): the
gradient reduce-scatter inside the group *sums* (divide factor 1, a plain sum on gloo),
and the step's loss is scaled by the worker's sample count, so each member ends backward
holding its rows of the group's sum of per-sample gradients, as the unsharded reducer
holds the whole of it.

Units: the module classes named in ``fsdp_units`` (every module of those classes), or by
size: walking the model bottom-up, a module becomes a unit once the parameters it holds
outside units already chosen reach ``1 / UNITS_BY_SIZE`` of the model's. The whole model
is the last unit (it holds what no other unit took).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import _random as dtensor_random

from contracts import sharded_state
from worker.engine import report
from worker.engine.checkpoint import to_cpu
from worker.engine.distributed import Topology
from worker.engine.sharded import full, local

UNITS_BY_SIZE = 32
"""By size, a unit holds at least 1/32 of the model's parameters: a model of many equal
blocks (an MLP's layers, a transformer's blocks) gets one unit a block, so at most a block or
two is gathered whole at a time (with 1/8, 12 blocks of 1/12 each were no unit of their own,
and the root, the whole model, was gathered at once: no memory saved)."""


class ShardingError(ValueError):
    """A model that cannot be sharded as asked (the message names the field to change)."""


MMAP_THRESHOLD_BYTES = 1 << 20
"""glibc's mmap threshold on a sharded worker: allocations from 1 MiB up are mapped on their
own and unmapped when freed."""


def return_freed_memory() -> str:
    """Make the allocator give large freed blocks back at once on this process, where it is
    glibc's: a fixed mmap threshold (:data:`MMAP_THRESHOLD_BYTES`,
    ``mallopt(M_MMAP_THRESHOLD)``, which also stops glibc raising it). By default glibc raises
    the threshold to the size of each mapped block freed, so a sharded worker's unit gathers
    (a unit's parameters and gradients, allocated and freed every step, by the main and the
    autograd threads) end up in heaps that keep them: measured on a 50M-parameter MLP (2
    workers, Adam), 1.7-1.9 GiB of data memory per worker with the default against 0.86-0.89
    GiB with a fixed threshold, where the model's whole state is 0.8 GiB. The price is a
    fresh mapping, faulted in, for every gather (a 10M-parameter step twice as long).

    Where the host asks for it (``POLYTRAIN_JEMALLOC``, :func:`worker.engine.ranks.allocator_env`)
    a sharded worker runs with jemalloc preloaded instead, which keeps the pages it freed for
    the next gather: then this changes nothing. Returns the allocator in use, ``jemalloc`` or
    ``glibc`` (:func:`allocator`). A no-op where glibc is absent."""
    name = allocator()
    if name == "glibc":
        try:
            ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        except (OSError, AttributeError):
            pass
    return name


def allocator() -> str:
    """``jemalloc`` where jemalloc serves this process's malloc (preloaded: its ``mallctl`` is
    in the global symbol scope; a library that bundles a private jemalloc does not put it
    there), else ``glibc``."""
    return "glibc" if _mallctl() is None else "jemalloc"


def purge_jemalloc() -> bool:
    """Hand every page jemalloc's arenas hold freed back to the system (``mallctl`` of
    ``arena.4096.purge``, 4096 being ``MALLCTL_ARENAS_ALL``): a sharded worker's jemalloc keeps
    freed pages for reuse (:data:`worker.engine.ranks.SHARDED_MALLOC_CONF`), so what a phase
    freed for good, the whole model once it is sharded, would otherwise stay resident.
    Returns whether it was done (False where jemalloc does not serve this process)."""
    mallctl = _mallctl()
    if mallctl is None:
        return False
    return int(mallctl(b"arena.4096.purge", None, None, None, ctypes.c_size_t(0))) == 0


def _mallctl() -> Any:
    """jemalloc's ``mallctl`` where jemalloc serves this process's malloc, else None."""
    try:
        return getattr(ctypes.CDLL(None), "mallctl", None)
    except OSError:
        return None


M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def size_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Submodules to wrap as units, bottom-up (children before parents), by size: a module
    whose parameters outside the units already chosen hold at least ``1 / UNITS_BY_SIZE``
    of the model's. The root is never among them (it is always the last unit)."""
    total = sum(p.numel() for p in model.parameters())
    least = max(1, total // UNITS_BY_SIZE)
    chosen: list[torch.nn.Module] = []

    def left(module: torch.nn.Module) -> int:  # parameters not in a chosen unit below
        own = sum(p.numel() for p in module.parameters(recurse=False))
        below = 0
        for child in module.children():
            count = left(child)
            if count >= least and child is not model:
                chosen.append(child)
            else:
                below += count
        return own + below

    left(model)
    return chosen


def named_units(model: torch.nn.Module, names: Sequence[str]) -> list[torch.nn.Module]:
    """Every submodule whose class name is in ``names``, outermost first skipped below an
    outer match (a unit inside a unit of the same list is wrapped too: FSDP2 nests them),
    listed bottom-up. Raises ShardingError naming ``fsdp_units`` when a name matches no
    module of the model, with the class names it has."""
    found = [m for m in model.modules() if type(m).__name__ in set(names) and m is not model]
    if type(model).__name__ in names:
        raise ShardingError(
            f"fsdp_units names {type(model).__name__!r}, the model itself, which is always "
            "the last unit: name the classes of its parts (blocks, layers)"
        )
    missing = sorted(set(names) - {type(m).__name__ for m in found})
    if missing:
        have = sorted({type(m).__name__ for m in model.modules()})
        raise ShardingError(
            f"fsdp_units names {missing}, which is no module class of the model; "
            f"its classes are {have}"
        )
    return list(reversed(found))


def shard_model(
    model: torch.nn.Module,
    topo: Topology,
    units: Sequence[str] = (),
    param_dtype: str = "float32",
) -> torch.nn.Module:
    """Wrap ``model`` (on ``topo.device``) with FSDP2 over this worker's group, in place:
    each unit (:func:`named_units` for ``units``, else :func:`size_units`), then the root.
    Every member of the group calls it alike. Gradients are summed over the group, not
    averaged. ``param_dtype`` ``bfloat16``: mixed precision (FSDP2's ``MixedPrecisionPolicy``):
    each unit's gathered parameters, so its forward and backward, in bfloat16, its gradients
    reduced in float32, the sharded parameters and the optimizer kept in float32, and the
    model's output cast back to float32 for the user's loss.
    Returns the model (its parameters are now DTensors: build the optimizer after).

    Raises ShardingError for ``units`` that name no module class, RuntimeError where the
    worker has no group (the parameter server)."""
    if topo.group is None:
        raise RuntimeError("only a compute worker's group shards its model")
    mesh = DeviceMesh.from_group(topo.group, device_type=topo.device.type)
    if topo.device.type != "cpu" and dtensor_random._rng_tracker is None:
        # DTensor's first random op on a CUDA mesh would make its RNG tracker, which syncs the
        # state by a broadcast over the world group, where only this group's ranks arrive
        # (distributed.py, "Process groups"); every rank is seeded alike
        # (contract.seed_everything), so there is nothing to sync.
        dtensor_random._rng_tracker = dtensor_random.OffsetBasedRNGTracker(
            mesh, run_state_sync=False
        )
    chosen = named_units(model, units) if units else size_units(model)
    low = getattr(torch, param_dtype)
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    for unit in chosen:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    # the model's output in float32, so the user's loss (and metrics) see what they would whole
    root = MixedPrecisionPolicy(
        param_dtype=low, reduce_dtype=torch.float32, output_dtype=torch.float32
    )
    fully_shard(model, mesh=mesh, mp_policy=root)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # gloo has no pre-multiplied sum; with a divide factor of 1 it is a plain sum.
            module.set_force_sum_reduction_for_comms(True)
    return model


def rows_of(whole: Tensor, like: DTensor) -> Tensor:
    """This worker's rows of ``whole`` (the full tensor, shaped as ``like``), as ``like`` is
    sharded; no communication (every member holds ``whole``)."""
    return distribute_tensor(
        whole, like.device_mesh, like.placements, src_data_rank=None
    ).to_local()


@torch.no_grad()
def load_whole_(param: Tensor, whole: Tensor) -> None:
    """Set ``param`` (sharded or not) from its whole value, in place."""
    if isinstance(param, DTensor):
        param.to_local().copy_(rows_of(whole.to(param.device).view(param.shape), param))
    else:
        param.copy_(whole.view_as(param))


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The optimizer's parameters in the order its ``state_dict`` numbers them (group by
    group: a user's groups, say weight decay on matrices only, reorder the model's)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def row_layout(param: Tensor, width: int) -> tuple[list[int], int]:
    """The rows of whole ``param``'s first dimension each of ``width`` members holds
    (:func:`chunk_rows`), and the elements of one row (a scalar: one row, the first's)."""
    if param.dim() == 0:
        return [1] + [0] * (width - 1), 1
    return chunk_rows(param.shape[0], width), param[0].numel() if param.shape[0] else 0


def rows_vector(params: Sequence[Tensor], member: int, width: int) -> Tensor:
    """Member ``member`` of ``width``'s rows of every whole parameter, flat and concatenated
    in order (what :func:`load_rows_` takes)."""
    parts = []
    for param in params:
        rows, _ = row_layout(param, width)
        start = sum(rows[:member])
        whole = param.detach().reshape(-1) if param.dim() == 0 else param.detach()
        parts.append(whole[start : start + rows[member]].reshape(-1))
    return torch.cat(parts)


@torch.no_grad()
def assemble_rows_(params: Sequence[Tensor], vectors: Sequence[Tensor]) -> None:
    """Set every whole parameter from each member's rows (``vectors``, in member order, each
    in :func:`rows_vector`'s layout): the inverse of :func:`rows_vector`."""
    offsets = [0] * len(vectors)
    for param in params:
        rows, size = row_layout(param, len(vectors))
        pieces = []
        for i, vector in enumerate(vectors):
            n = rows[i] * size
            pieces.append(vector[offsets[i] : offsets[i] + n])
            offsets[i] += n
        param.copy_(assemble(param.shape, pieces))


def rows_numel(params: Sequence[Tensor], member: int, width: int) -> int:
    """Elements in member ``member`` of ``width``'s :func:`rows_vector` of whole ``params``."""
    total = 0
    for param in params:
        rows, size = row_layout(param, width)
        total += rows[member] * size
    return total


@torch.no_grad()
def load_rows_(params: Sequence[Tensor], vector: Tensor) -> int:
    """Copy this worker's rows of every parameter from ``vector`` (:func:`rows_vector`'s
    layout) into its sharded parameters; returns the elements read."""
    offset = 0
    for param in params:
        mine = local(param)
        n = mine.numel()
        mine.copy_(vector[offset : offset + n].view_as(mine))
        offset += n
    return offset


def like(param: DTensor, rows: Tensor) -> DTensor:
    """``rows`` (this worker's, as :func:`rows_of` gives them) as a DTensor sharded as
    ``param``."""
    return DTensor.from_local(
        rows,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def chunk_rows(n: int, members: int) -> list[int]:
    """Rows of a first dimension of ``n`` each of ``members`` holds under ``Shard(0)``
    (torch.chunk's split: ``ceil(n / members)`` each, the last ones short or empty)."""
    size = -(-n // members) if n else 0
    return [max(0, min(n, (i + 1) * size) - i * size) for i in range(members)]


def assemble(shape: torch.Size, parts: Sequence[Tensor]) -> Tensor:
    """The whole tensor of ``shape`` from every member's rows, in member order."""
    if not shape:
        return parts[0]
    return torch.cat([p.reshape(-1, *shape[1:]) for p in parts]).reshape(shape)


def shard_state(state_dict: dict[str, Any], params: Sequence[Tensor]) -> dict[str, Any]:
    """An optimizer ``state_dict`` of the whole model (the parameter server's, a checkpoint's)
    made this worker's: each state tensor shaped as its sharded parameter becomes a DTensor
    of this worker's rows, so the sharded optimizer can load it. ``params``: the optimizer's,
    in its numbering (:func:`optimizer_params`)."""
    state: dict[Any, dict[str, Any]] = {}
    for key, values in state_dict["state"].items():
        param = params[int(key)]
        state[key] = {}
        for name, value in values.items():
            if isinstance(param, DTensor) and isinstance(value, Tensor) and value.dim() > 0:
                value = like(param, rows_of(value.to(param.device).view(param.shape), param))
            state[key][name] = value
    return {"state": state, "param_groups": state_dict["param_groups"]}


@dataclass(frozen=True)
class Rows:
    """In an optimizer state's outline (:func:`outline`): a state tensor sent by rows, or
    whole where ``shape`` is given (a whole worker's)."""

    dtype: torch.dtype
    shape: tuple[int, ...] | None = None


def outline(state_dict: dict[str, Any], whole: bool = False) -> dict[str, Any]:
    """An optimizer ``state_dict()`` with each state tensor shaped as its parameter (one
    dimension or more) replaced by :class:`Rows` (with its shape when ``whole``: a worker
    that holds the whole model sends each tensor whole): what a receiver needs to take them
    (:func:`receive_state_rows`), or a state folder's outline (:func:`save_state`); scalars
    (Adam's ``step``) and the parameter groups are kept, any tensor among them on the CPU (it
    unpickles on a host without the worker's device)."""
    state = {
        key: {
            name: Rows(value.dtype, tuple(value.shape) if whole else None)
            if isinstance(value, Tensor) and value.dim() > 0
            else local(value)
            if isinstance(value, Tensor)
            else value
            for name, value in values.items()
        }
        for key, values in state_dict["state"].items()
    }
    return to_cpu({"state": state, "param_groups": state_dict["param_groups"]})


def state_tensors(state_dict: dict[str, Any]) -> dict[str, Tensor]:
    """An optimizer ``state_dict``'s state tensors (one dimension or more), keyed as a state
    folder keeps them (``contracts.sharded_state.dcp_key``): what a checkpoint writes."""
    return {
        sharded_state.dcp_key(key, name): value
        for key, values in state_dict["state"].items()
        for name, value in values.items()
        if isinstance(value, Tensor) and value.dim() > 0
    }


def save_state(
    optimizer: torch.optim.Optimizer, folder: Path, topo: Topology, *, sharded: bool
) -> dict[str, Any]:
    """Write this worker's optimizer state into state folder ``folder`` with
    torch.distributed.checkpoint and report each file it wrote (:func:`report.checkpoint_part`,
    for its agent to upload). ``sharded``: every member of this worker's sharded group calls
    it together, and each writes its rows of each state tensor, all at once (one
    ``__<member>_0.distcp`` file each, DCP's ``.metadata`` from the first); else this worker
    alone writes its whole state (a group leader's local optimizer under ``periodic`` or
    ``diloco``). Nothing is gathered: the parameter server gets the returned outline only
    (``contracts.sharded_state.outline_state``: the scalars, the parameter groups, and every
    file of the folder). Raises OSError (wrapped in DCP's CheckpointException, a
    BaseException, where sharded) when the folder cannot be written."""
    state_dict = optimizer.state_dict()
    files = save_folder(state_tensors(state_dict), folder, topo if sharded else None)
    return sharded_state.outline_state(
        outline(state_dict), lambda v: isinstance(v, Rows), folder.name, files
    )


def save_folder(tensors: dict[str, Tensor], folder: Path, topo: Topology | None) -> list[str]:
    """Write ``tensors`` into state folder ``folder`` with torch.distributed.checkpoint:
    with ``topo``, every member of its group at once (each its own ``__<member>_0.distcp``,
    DCP's ``.metadata`` from the first), else on this process alone; and report each file
    this process wrote (:func:`report.checkpoint_part`, for its agent to upload). Returns
    every file of the folder, ``.metadata`` first. Raises what DCP raises (wrapped in its
    CheckpointException, a BaseException, with ``topo``)."""
    if topo is not None:
        metadata = dcp.save(tensors, checkpoint_id=folder, process_group=topo.group)
        member = topo.group_ranks.index(topo.rank)
    else:
        with sharded_state.single_process():
            metadata = dcp.save(tensors, checkpoint_id=folder, no_dist=True)
        member = 0
    files = sorted({str(info.relative_path) for info in metadata.storage_data.values()})
    for name in [".metadata", *files] if member == 0 else files:
        if name == ".metadata" or name.startswith(f"__{member}_"):
            report.checkpoint_part(str(folder / name))
    return [".metadata", *files]


def load_state_rows(
    optimizer: torch.optim.Optimizer, outlined: dict[str, Any], folder: Path
) -> None:
    """Load the optimizer state a checkpoint keeps in state folder ``folder``
    (``outlined``: its outline, :func:`save_state`) into ``optimizer``, reading only
    what this worker holds: a sharded worker its rows as its group now lays them out (any
    number of members: DCP reshards), a whole worker every row. Raises ValueError for a
    folder that is not the outline's, RuntimeError (DCP's) for a missing tensor."""
    ref = sharded_state.reference(outlined)
    if ref is None:
        raise ValueError("the optimizer state names no state folder")
    files = [p.split("/", 1)[1] for p in sharded_state.part_paths(ref)]
    stored = sharded_state.read_metadata(folder, files).state_dict_metadata
    params = optimizer_params(optimizer)
    template: dict[str, Tensor] = {}
    for key, name, _ in sharded_state.marked_entries(outlined):
        item = stored.get(sharded_state.dcp_key(key, name))
        if item is None:
            raise ValueError(f"the state folder {folder.name} has no optimizer state {key}.{name}")
        param, dtype = params[int(key)], item.properties.dtype
        if isinstance(param, DTensor) and tuple(item.size) == tuple(param.shape):
            mine = torch.empty(param.to_local().shape, dtype=dtype, device=param.device)
            template[sharded_state.dcp_key(key, name)] = like(param, mine)
        else:  # whole; or a state not shaped as its parameter (Adafactor's row and column)
            template[sharded_state.dcp_key(key, name)] = torch.empty(
                item.size, dtype=dtype, device=param.device
            )
    sharded_state.load_into(template, folder, files)
    optimizer.load_state_dict(sharded_state.filled(outlined, template))


def _in_order(state: dict[Any, dict[str, Any]]) -> list[tuple[Any, str]]:
    return [(key, name) for key in sorted(state, key=int) for name in sorted(state[key])]


def send_state_rows(state_dict: dict[str, Any], dst: int, group: Any) -> None:
    """Send rank ``dst`` over ``group`` each state tensor of this worker's optimizer (a
    sharded worker: its rows of it), one tensor at a time in the outline's order
    (point to point): no copy of the whole state is made, as pickling it would (twice)."""
    state = state_dict["state"]
    for key, name in _in_order(state):
        value = state[key][name]
        if isinstance(value, Tensor) and value.dim() > 0:
            dist.send(local(value).detach().contiguous().cpu(), dst=dst, group=group)


def receive_state_rows(outlined: dict[str, Any], source: int, group: Any) -> dict[str, Any]:
    """The whole optimizer ``state_dict`` rank ``source`` sends (:func:`send_state_rows`, its
    :func:`outline` made with ``whole``: each state tensor's shape given), each tensor
    received as it arrives: no copy of the whole state is pickled (a parked group taking the
    source's back, ``worker.engine.run``)."""
    state: dict[Any, dict[str, Any]] = {k: dict(v) for k, v in outlined["state"].items()}
    for key, name in _in_order(state):
        value = state[key][name]
        if not isinstance(value, Rows):
            continue
        if value.shape is None:
            raise ValueError(f"state {key}.{name} was outlined without its shape (not whole)")
        whole = torch.empty(value.shape, dtype=value.dtype)
        dist.recv(whole, src=source, group=group)
        state[key][name] = whole
    return {"state": state, "param_groups": outlined["param_groups"]}


def group_sum_(grads: Sequence[Tensor | None], params: Sequence[Tensor], topo: Topology) -> None:
    """The step's gradient sum across the groups, for a task with a sharded group: each
    group's sum (sharded: gathered a parameter at a time; unsharded: allreduced in the
    group), then the leaders' ring allreduce (``topo.cross``), then the leader's broadcast in the
    group; a sharded worker keeps its rows. Every compute worker calls it alike; ``grads``
    are the parameters' gradients after backward (None: not reached), set in place; a frozen
    parameter (``requires_grad`` False) keeps none, so the optimizer skips it."""
    members = len(topo.group_ranks)
    for param, grad in zip(params, grads, strict=True):
        if not param.requires_grad:  # frozen on every rank alike: no gradient, not stepped
            param.grad = None
            continue
        if isinstance(param, DTensor):
            whole = full(grad) if grad is not None else None
        else:
            whole = grad
        if whole is None:  # a parameter the loss did not reach: zeros
            whole = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
        if not isinstance(param, DTensor) and members > 1:
            dist.all_reduce(whole, group=topo.group)
        if topo.cross is not None:  # the ring takes a CUDA tensor through a CPU copy
            topo.cross.all_reduce(whole)
        if members > 1:
            dist.broadcast(whole, src=topo.group_ranks[0], group=topo.group)
        if isinstance(param, DTensor):
            param.grad = like(param, rows_of(whole.to(param.device), param))
        else:
            param.grad = whole
