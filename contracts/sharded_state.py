"""A checkpoint's optimizer states kept out of its file: written by the workers that hold
them with torch.distributed.checkpoint (DCP), read back by rows, consolidated on demand.

No process gathers a group's optimizer state for a checkpoint. Where the group a checkpoint
takes its optimizer from holds it sharded (``sharding: fsdp``), each member writes its rows
of every state tensor (Adam's two moments) into the checkpoint's *state folder*,
``<checkpoint name>.dcp``, at once with the others: one ``__<member>_0.distcp`` file each,
and the first member DCP's ``.metadata``. Under ``periodic`` and ``diloco`` (an optimizer
per group) each group's leader writes its group's state into a folder of its own,
``<checkpoint name>.g<group>.dcp``, all leaders at once. The checkpoint file itself
(``step-8.pt``: the parameter server's ``torch.save`` dict) keeps, in place of each state,
its outline: the scalars (Adam's ``step``), the parameter groups, each state tensor replaced
by the marker ``"dcp:<dtype>"``, and ``sharded_state`` = ``{"folder": "step-8.pt.dcp",
"files": [...]}``, the files that make it whole. ``final.pt`` names the last epoch's folder
(the same state).

On resume each worker reads its own view (:func:`load_into`): a sharded worker its rows as
its new group lays them out, so a group of 2 resumes on 3 (resharding), a whole worker every
row. The portal builds the one consolidated ``state_dict`` a user downloads on demand
(:func:`consolidate`, ``python -m contracts.sharded_state``), in a process of its own.

DCP's ``.metadata`` is a pickle, and the files come from ranks that run user code: every read
here goes through :class:`SafeReader`, which unpickles only DCP's metadata classes, opens only
the files listed, and takes tensors only (``torch.load(weights_only=True)``, DCP's own).
docs/heterogeneity.md, "Optimizer states out of the checkpoint file".
"""

from __future__ import annotations

import math
import pickle
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

FOLDER_SUFFIX = ".dcp"
"""A state folder is named after its checkpoint: ``step-8.pt`` keeps ``step-8.pt.dcp``."""
MARK = "dcp:"
"""A state tensor kept in the state folder, in the checkpoint's optimizer outline:
``"dcp:float32"``."""
PART_PATTERN = r"^(\.metadata|__[0-9]{1,6}_[0-9]{1,6}\.distcp)$"
"""The files DCP's file system writer makes, one pattern for every one of them."""
PART = re.compile(PART_PATTERN)
FOLDER_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,195}\.dcp$"
FOLDER = re.compile(FOLDER_PATTERN)
MAX_PARTS = 4097
"""The most files a checkpoint's state folders may have together (each: DCP's ``.metadata``
and one file a member). Their names travel in its upload's form (``parts``, a JSON array:
backend/agent_api/router.py), not its query string, where a proxy's 8 KiB request line
held some 180."""
MAX_GROUP_STATES = 64
"""The most groups' optimizer states a consolidation builds (a task has 16 groups at most;
a parked group's entry names the source group's folder, each its own copy)."""
MAX_STATE_BYTES = 64 << 30
"""The largest state a consolidation builds (its metadata claims the tensors' sizes)."""


def folder_of(checkpoint_name: str, group: int | None = None) -> str:
    """The state folder's name of checkpoint ``checkpoint_name`` (``step-8.pt.dcp``), or of
    group ``group``'s own optimizer in it (``step-8.pt.g1.dcp``)."""
    own = "" if group is None else f".g{group}"
    return checkpoint_name + own + FOLDER_SUFFIX


def slice_folder(checkpoint_name: str, shard: int) -> str:
    """The state folder of shard ``shard``'s slice of the model in checkpoint
    ``checkpoint_name`` (``step-8.pt.s1.dcp``), written by that shard's owner
    (:data:`MODEL_SLICES`)."""
    return f"{checkpoint_name}.s{shard}{FOLDER_SUFFIX}"


def shard_of_folder(folder: str) -> int | None:
    """The shard whose slice of the model folder ``folder`` holds (``step-8.pt.s1.dcp``: 1),
    None for an optimizer state's folder: the inverse of :func:`slice_folder`."""
    found = re.fullmatch(r".+\.s([0-9]{1,6})" + re.escape(FOLDER_SUFFIX), folder)
    return int(found.group(1)) if found else None


def group_of_folder(folder: str) -> int | None:
    """The group whose own optimizer state folder ``folder`` is (``step-8.pt.g1.dcp``: 1),
    None for a folder of the task's one replica or a sharded group's rows (``step-8.pt.dcp``):
    the inverse of :func:`folder_of`."""
    found = re.fullmatch(r".*\.g([0-9]{1,6})" + re.escape(FOLDER_SUFFIX), folder)
    return int(found.group(1)) if found else None


def reference(state_dict: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``sharded_state`` of an optimizer outline (``{"folder", "files"}``), or None for
    a whole state (or none)."""
    if not isinstance(state_dict, dict):
        return None
    ref = state_dict.get("sharded_state")
    return ref if isinstance(ref, dict) else None


def part_paths(ref: dict[str, Any]) -> list[str]:
    """``folder/file`` of every file of reference ``ref``, checked: raises ValueError for a
    folder or file name that is not DCP's (a path, ``..``, another file)."""
    folder = str(ref.get("folder", ""))
    if not FOLDER.fullmatch(folder):
        raise ValueError(f"sharded state folder {folder[:200]!r} is not <checkpoint>.dcp")
    files = [str(f) for f in ref.get("files", [])]
    bad = [f[:200] for f in files if not PART.fullmatch(f)]
    if bad or ".metadata" not in files:
        raise ValueError(
            f"sharded state files {bad or files} are not DCP's (.metadata, __<n>_0.distcp)"
        )
    return [f"{folder}/{f}" for f in files]


def check_part(path: str) -> tuple[str, str]:
    """``(folder, file)`` of part path ``path`` (``step-8.pt.dcp/__0_0.distcp``). Raises
    ValueError for anything but a state folder's name and one of DCP's file names."""
    folder, _, name = path.partition("/")
    if not FOLDER.fullmatch(folder) or not PART.fullmatch(name):
        raise ValueError(
            f"{path[:200]!r} is no part of a state folder: '<checkpoint>.dcp/<file>', the "
            "file '.metadata' or '__<n>_<m>.distcp'"
        )
    return folder, name


def marked(dtype: Any) -> str:
    """The outline's marker of a state tensor of ``dtype`` kept in the state folder."""
    return MARK + str(dtype).removeprefix("torch.")


def outline_state(
    state_dict: dict[str, Any], is_row: Callable[[Any], bool], folder: str, files: Sequence[str]
) -> dict[str, Any]:
    """An optimizer ``state_dict`` with every tensor ``is_row`` accepts (one shaped as its
    parameter) replaced by its :func:`marked` dtype, and ``sharded_state`` set: what a
    checkpoint keeps of a state the state folder holds."""
    state = {
        key: {n: marked(v.dtype) if is_row(v) else v for n, v in values.items()}
        for key, values in state_dict["state"].items()
    }
    return {
        "state": state,
        "param_groups": state_dict["param_groups"],
        "sharded_state": {"folder": folder, "files": sorted(files)},
    }


def marked_entries(outline: dict[str, Any]) -> Iterator[tuple[Any, str, str]]:
    """``(state key, state name, dtype name)`` of every marked tensor of ``outline``."""
    for key, values in outline["state"].items():
        for name, value in values.items():
            if isinstance(value, str) and value.startswith(MARK):
                yield key, name, value.removeprefix(MARK)


def dcp_key(key: Any, name: str) -> str:
    """The flat key DCP gives state tensor ``name`` of parameter ``key``."""
    return f"state.{key}.{name}"


def filled(outline: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """``outline`` as the optimizer ``state_dict`` it stands for: each marker replaced by its
    tensor from ``tensors`` (keyed by :func:`dcp_key`), ``sharded_state`` dropped."""
    state = {
        key: {
            name: tensors[dcp_key(key, name)]
            if isinstance(value, str) and value.startswith(MARK)
            else value
            for name, value in values.items()
        }
        for key, values in outline["state"].items()
    }
    return {"state": state, "param_groups": outline["param_groups"]}


# -- reading: DCP's metadata unpickled from an allow-list ------------------------------

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes, torch's dtypes and layouts, and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"DCP metadata may not name {module}.{name}")


def read_metadata(folder: Path, files: Sequence[str]) -> Any:
    """The DCP ``Metadata`` of ``folder``, checked: only tensors (no pickled objects), each
    tensor covered exactly by its stored chunks (no dimension negative, no chunk outside it,
    their elements summing to its own), each chunk stored in one of ``files``, and no more
    bytes claimed than those files hold (DCP stores tensors uncompressed), nor over
    :data:`MAX_STATE_BYTES`. Raises ValueError for anything else, pickle.UnpicklingError for
    a class outside the allow-list."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    with open(folder / ".metadata", "rb") as fh:
        metadata = _MetadataUnpickler(fh).load()
    if not isinstance(metadata, Metadata):
        raise ValueError("the state folder's .metadata is not DCP metadata")
    total = 0
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise ValueError(f"sharded state entry {key[:200]!r} is not a tensor")
        _check_chunks(key, item)
        total += item.size.numel() * item.properties.dtype.itemsize
    stored = sum((folder / f).stat().st_size for f in files if f != ".metadata")
    if total > min(stored, MAX_STATE_BYTES):
        raise ValueError(f"sharded state claims {total} bytes; its files hold {stored}")
    listed = set(files)
    for info in (metadata.storage_data or {}).values():
        if str(info.relative_path) not in listed:
            raise ValueError(f"sharded state names file {str(info.relative_path)[:200]!r}")
    return metadata


def _check_chunks(key: str, item: Any) -> None:
    """Raise ValueError unless tensor ``item``'s chunks lie inside it and cover it once."""
    size = list(item.size)
    covered = 0
    for chunk in item.chunks:
        offsets, sizes = list(chunk.offsets), list(chunk.sizes)
        inside = len(offsets) == len(sizes) == len(size) and all(
            o >= 0 and n >= 0 and o + n <= d for o, n, d in zip(offsets, sizes, size, strict=True)
        )
        if not inside:
            raise ValueError(f"sharded state entry {key[:200]!r} has a chunk outside its shape")
        covered += math.prod(sizes)
    if any(d < 0 for d in size) or covered != math.prod(size):
        raise ValueError(f"sharded state entry {key[:200]!r} is not covered by its chunks")


def reader(folder: Path, files: Sequence[str]) -> Any:
    """A DCP storage reader of ``folder`` whose metadata is read by :func:`read_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(Path(folder), files)
            metadata.storage_meta = StorageMeta()  # as DCP's own reader: its path dropped
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(folder))


def load_into(template: dict[str, Any], folder: Path, files: Sequence[str]) -> None:
    """Fill ``template`` (``{dcp_key: tensor}``: whole tensors, or DTensors laid out as this
    worker's group shards them) from the state folder, in place, on this process alone.
    Raises ValueError / pickle.UnpicklingError for a folder :func:`read_metadata` refuses,
    RuntimeError (DCP's) for a key or shape the folder lacks."""
    import torch.distributed.checkpoint as dcp

    with single_process():
        dcp.load(template, storage_reader=reader(folder, files), no_dist=True)


@contextmanager
def single_process() -> Iterator[None]:
    """Around a DCP call on this process alone (``no_dist``): without DCP's warning that it
    assumes so, which every such call would print into the rank's log."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def references(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every ``sharded_state`` a checkpoint dict names: its optimizer's, each group's
    (``group_optimizers``, the local optimizers of ``periodic`` and ``diloco``), and each
    slice of its model (:data:`MODEL_SLICES`)."""
    outlines = [state.get("optimizer"), *(state.get("group_optimizers") or {}).values()]
    refs = [ref for ref in map(reference, outlines) if ref is not None]
    return refs + list((state.get(MODEL_SLICES) or {}).get("slices", []))


def all_part_paths(state: dict[str, Any]) -> list[str]:
    """``folder/file`` of every file of every state folder ``state`` names, each once."""
    return sorted({path for ref in references(state) for path in part_paths(ref)})


def _whole(
    outline: dict[str, Any], base: Path, read: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The optimizer ``state_dict`` ``outline`` stands for, read whole from its state folder
    in ``base``. ``read``: the tensors of the folders read so far, by folder, so that
    outlines naming one folder (a parked group's names the source group's) read it once,
    each taking its own copy (two optimizers loaded from them must not step one tensor)."""
    import torch

    ref = reference(outline)
    assert ref is not None
    files = [p.split("/", 1)[1] for p in part_paths(ref)]
    folder = base / str(ref["folder"])
    if read is not None and folder.name in read:
        template = {key: tensor.clone() for key, tensor in read[folder.name].items()}
    else:
        metadata = read_metadata(folder, files)
        template = {
            key: torch.empty(item.size, dtype=item.properties.dtype)
            for key, item in metadata.state_dict_metadata.items()
        }
        load_into(template, folder, files)
        if read is not None:
            read[folder.name] = template
    for key, name, _ in marked_entries(outline):
        if dcp_key(key, name) not in template:
            raise ValueError(f"the state folder has no {dcp_key(key, name)!r}")
    return filled(outline, template)


# -- the model in slices: written by the parameter server's shard owners ---------------

MODEL_SLICES = "model_slices"
"""The checkpoint key naming where its model's parameters are, when the parameter server's
owners wrote them (their rounds under ``periodic`` and ``diloco``: ``ps_shards`` 2 or more,
or one shard beside a sharded group), each owner its slice of the flat parameter vector, at
once, and none gathered them::

    {"params": [[offset, [shape]], ...],   # each parameter's place in the flat vector, in
                                           # model.parameters() order, end to end
     "names": {state_dict key: index},     # which parameter each marked model entry is
     "slices": [{"folder": "step-8.pt.s0.dcp", "files": [...]}, ...]}   # shard order

Each slice's folder holds ``params`` (its slice, 1-D) and, under ``diloco`` once the outer
optimizer has momentum, ``momentum`` (the same slice of it). The checkpoint's ``model``
keeps the buffers whole and marks each parameter (:func:`marked`); its
``outer_optimizer`` marks each ``momentum_buffer`` (one SGD's state over the parameters)."""


def model_outline(
    state_dict: dict[str, Any], names: dict[str, int], params: Sequence[tuple[int, Sequence[int]]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model, model_slices)`` of a checkpoint whose model's parameters its slices hold:
    ``state_dict`` with every entry of ``names`` (its parameter's index in ``params``) that
    it has replaced by its :func:`marked` dtype, and the :data:`MODEL_SLICES` entry without
    its ``slices`` (the writer adds them)."""
    names = {k: i for k, i in names.items() if k in state_dict}
    model = {k: marked(v.dtype) if k in names else v for k, v in state_dict.items()}
    layout = {"params": [[int(o), [int(d) for d in shape]] for o, shape in params]}
    return model, {**layout, "names": dict(names), "slices": []}


def _layout(layout: Any) -> tuple[list[tuple[int, tuple[int, ...]]], int]:
    """The parameters' ``(offset, shape)`` of a :data:`MODEL_SLICES` entry and the flat
    vector's length, checked: each parameter starts where the one before it ends, from 0,
    with dimensions of 0 or more. Raises ValueError for anything else."""
    if not isinstance(layout, dict) or not isinstance(layout.get("params"), list):
        raise ValueError("the model's outline has no parameter layout")
    params, end = [], 0
    for entry in layout["params"]:
        try:
            offset, shape = int(entry[0]), tuple(int(d) for d in entry[1])
        except (TypeError, ValueError, IndexError, KeyError):
            raise ValueError("the model's outline lays out a parameter wrongly") from None
        if offset != end:
            raise ValueError(f"the model's outline places a parameter at {offset}, not {end}")
        if any(d < 0 for d in shape):
            raise ValueError(f"the model's outline gives a parameter the shape {list(shape)}")
        params.append((offset, shape))
        end += math.prod(shape)
    return params, end


def _slice_refs(layout: dict[str, Any], name: str | None) -> list[dict[str, Any]]:
    """The :data:`MODEL_SLICES` entry's slice references, checked: one folder a shard, in
    shard order (``<checkpoint>.s<k>.dcp``, the same checkpoint name: ``name`` where given),
    none twice. Raises ValueError for anything else."""
    refs = layout.get("slices")
    if not isinstance(refs, list) or not refs or not all(isinstance(r, dict) for r in refs):
        raise ValueError("the model's outline names no slices")
    names = [str(ref.get("folder", "")) for ref in refs]
    stems = {name.rsplit(".s", 1)[0] for name in names}
    shards = [shard_of_folder(name) for name in names]
    expected = {name} if name is not None else stems
    if shards != list(range(len(refs))) or len(stems) != 1 or stems != expected:
        raise ValueError(f"the model's slices {names[:8]} are not one checkpoint's, in order")
    return refs


def _flat(refs: Sequence[dict[str, Any]], base: Path, key: str, numel: int) -> Any:
    """The slices' ``key`` tensors, read from their folders in ``base``, as one vector of
    ``numel`` elements; None where no slice holds ``key``. Raises ValueError where only some
    do, where one is not a vector, or where they do not make ``numel`` elements together."""
    import torch

    items = []
    for ref in refs:
        files = [p.split("/", 1)[1] for p in part_paths(ref)]
        folder = base / str(ref["folder"])
        items.append((folder, files, read_metadata(folder, files).state_dict_metadata.get(key)))
    if all(item is None for _, _, item in items):
        return None
    if any(item is None or len(item.size) != 1 for _, _, item in items):
        raise ValueError(f"the model's slices do not each hold {key!r} as a vector")
    if len({item.properties.dtype for _, _, item in items}) != 1:
        raise ValueError(f"the model's slices hold {key!r} in more than one dtype")
    held = sum(item.size[0] for _, _, item in items)
    if held != numel:
        raise ValueError(f"the model's slices hold {held} elements of {key!r}; it has {numel}")
    parts = []
    for folder, files, item in items:
        template = {key: torch.empty(item.size, dtype=item.properties.dtype)}
        load_into(template, folder, files)
        parts.append(template[key])
    return torch.cat(parts)


def _dtype(marker: Any) -> Any:
    """The torch dtype a :func:`marked` entry names. Raises ValueError for another value."""
    import torch

    named = marker.removeprefix(MARK) if isinstance(marker, str) and marker.startswith(MARK) else ""
    dtype = getattr(torch, named, None) if named else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the model's outline marks an entry {str(marker)[:60]!r}")
    return dtype


def _unfilled(value: Any) -> bool:
    """True where ``value`` (a state dict, or a part of one) still holds a :func:`marked`
    entry."""
    if isinstance(value, str):
        return value.startswith(MARK)
    if isinstance(value, dict):
        return any(_unfilled(v) for v in value.values())
    return False


def fill_model(state: dict[str, Any], base: Path, name: str | None = None) -> dict[str, Any]:
    """Checkpoint dict ``state`` with its model's parameters (and its outer optimizer's
    momentum) read from the slice folders :data:`MODEL_SLICES` names, in ``base``, and that
    entry dropped: the checkpoint as one server would have written it. ``name``: the
    checkpoint's file name, which the slices must be named after (None where the file was
    renamed: a resume's copy). Each parameter is read once, in its marked dtype; names of one
    parameter (tied weights) share its tensor. A checkpoint whose model is whole is returned
    as it is. Raises ValueError for an outline or slices that do not make the model, or a
    marked entry left unfilled; pickle errors as :func:`read_metadata`."""
    layout = state.pop(MODEL_SLICES, None)
    if layout is None:
        if _unfilled(state.get("model")) or _unfilled(state.get("outer_optimizer")):
            raise ValueError("the checkpoint marks its model's parameters but names no slices")
        return state
    params, numel = _layout(layout)
    refs = _slice_refs(layout, name)
    model, names = state.get("model"), layout.get("names")
    if not isinstance(model, dict) or not isinstance(names, dict):
        raise ValueError("the model's outline names no parameters")
    flat = _flat(refs, base, "params", numel)
    if flat is None:
        raise ValueError("the model's slices hold no parameters")

    def filler(source: Any) -> Callable[[Any, Any], Any]:
        made: dict[int, Any] = {}

        def piece(index: Any, marker: Any) -> Any:
            if not isinstance(index, int) or not 0 <= index < len(params):
                raise ValueError(f"the model's outline names parameter {repr(index)[:20]}")
            dtype = _dtype(marker)
            if index not in made:
                offset, shape = params[index]
                part = source[offset : offset + math.prod(shape)].view(shape)
                made[index] = part.to(dtype, copy=True)  # its own storage: saved alone, alone
            if made[index].dtype != dtype:
                raise ValueError(f"the model's outline marks parameter {index} in two dtypes")
            return made[index]

        return piece

    piece = filler(flat)
    for key, index in names.items():
        if key not in model:
            raise ValueError(f"the model's outline names {str(key)[:200]!r}, which it lacks")
        model[key] = piece(index, model[key])
    del flat  # each parameter is its own copy: a tensor saved alone saves itself only
    outer = state.get("outer_optimizer")
    held = outer.get("state") if isinstance(outer, dict) else None
    if isinstance(held, dict) and _unfilled(held):
        momentum = _flat(refs, base, "momentum", numel)
        if momentum is None:
            raise ValueError("the outer optimizer's momentum is in no slice of the model")
        take = filler(momentum)
        for key, entry in held.items():
            if not isinstance(entry, dict) or set(entry) != {"momentum_buffer"}:
                raise ValueError("the outer optimizer's state holds more than its momentum")
            entry["momentum_buffer"] = take(key, entry["momentum_buffer"])
    if _unfilled(model) or _unfilled(outer):
        raise ValueError("the model's outline leaves a marked entry unfilled")
    return state


def consolidate(checkpoint: Path, out: Path) -> None:
    """Write to ``out`` checkpoint ``checkpoint`` with every optimizer state whole: each one
    a state folder holds (its optimizer's, each group's) read from that folder, beside the
    checkpoint, into every marked tensor, and its model's parameters (and outer momentum)
    from the shard owners' slices (:func:`fill_model`). A checkpoint that names no state
    folder is written as it is. Raises ValueError for a checkpoint or folder that does not
    match, pickle errors for a file that is not one."""
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError("the checkpoint is not a dict")
    fill_model(state, checkpoint.parent, checkpoint.name)
    read: dict[str, dict[str, Any]] = {}
    if reference(state.get("optimizer")) is not None:
        state["optimizer"] = _whole(state["optimizer"], checkpoint.parent, read)
    groups = state.get("group_optimizers") or {}
    if len(groups) > MAX_GROUP_STATES:
        raise ValueError(f"the checkpoint names {len(groups)} groups' optimizer states")
    for g, outline in groups.items():
        if reference(outline) is not None:
            groups[g] = _whole(outline, checkpoint.parent, read)
    torch.save(state, out)


def _one_line(exc: BaseException, folder: Path) -> str:
    """``exc`` said in one line, without the portal's folders: DCP's CheckpointException (its
    text a traceback of every rank's failure) by its first failure, any text by its first
    line."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, _checkpoint_error()) and isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) and first else exc
    text = str(exc).replace(str(folder), "<checkpoints>").strip()
    line = text.splitlines()[0] if text else ""
    if isinstance(exc, pickle.UnpicklingError):  # torch's goes on to advise unsafe loading
        line = line.split(". ")[0] + ": a file of the checkpoint's state is not a tensor file"
    return f"{type(exc).__name__}: {line}"[:500]


def _checkpoint_error() -> type[BaseException]:
    """DCP's CheckpointException (a BaseException: a corrupt ``.distcp`` file raises it)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def main(argv: list[str] | None = None) -> int:
    """``python -m contracts.sharded_state CHECKPOINT OUT``: :func:`consolidate`."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m contracts.sharded_state CHECKPOINT OUT", file=sys.stderr)
        return 2
    try:
        consolidate(Path(args[0]), Path(args[1]))
    except (Exception, _checkpoint_error()) as exc:  # noqa: BLE001 - malformed files, in a line
        print(_one_line(exc, Path(args[0]).parent), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
