"""Checkpoint files: everything needed to continue a task exactly where it stopped.

A checkpoint is a ``torch.save`` dict written by the parameter server::

    model             state_dict of the global model: parameters and buffers (BatchNorm
                      statistics, combined as docs/heterogeneity.md "Buffers" says); where
                      the parameter server's owners hold the model (periodic and diloco
                      with ps_shards > 1 or a sharded group), each parameter marked and
                      ``model_slices`` naming the folders
                      ``<name>.s<shard>.dcp`` its owners wrote (contracts/sharded_state.py)
    optimizer         sync: the outline of the workers' optimizer replica, its tensors in the
                      state folder ``<name>.dcp`` the source worker (or a sharded source
                      group's members) wrote (contracts/sharded_state.py); quorum: the
                      state_dict of the parameter server's own; None with periodic, diloco
    group_optimizers  {group index: the outline of each group's local optimizer (periodic,
                      diloco), its tensors in the state folder ``<name>.g<index>.dcp``} or None
    epoch, step       epoch being trained (0-based) and optimizer steps done since the start
    epoch_complete    True at an epoch end: resume starts epoch + 1
    split             :meth:`worker.engine.split.SplitState.state_dict` (shards, shares, position)
    rng               {rank: torch RNG state (uint8 tensor)} of every compute worker
    excluded_groups   names of the groups left out for disagreeing (worker.engine.agreement)
    outer_optimizer   diloco: one SGD's state over the model's parameters (its momentum
                      marked where ``model_slices`` holds it); None elsewhere

Written every ``checkpoint_every`` steps (``step-{step}.pt``; with periodic sync
at the first sync point after the mark), at every epoch end (``epoch-{e}.pt``)
and at the end (``final.pt``). Quorum sync checkpoints at epoch ends only,
because its groups are at different steps inside an epoch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from contracts import sharded_state
from worker.engine import report


def save_checkpoint(
    path: Path, state: dict[str, Any], provenance: dict[str, Any] | None = None
) -> None:
    """Write ``state`` to ``path`` atomically (temp file + rename) and report it, with the
    shard ``provenance`` (:meth:`worker.engine.provenance.ShardLedger.drain`) when given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)
    report.checkpoint(
        str(path),
        step=int(state["step"]),
        epoch=int(state["epoch"]),
        provenance=provenance,
        parts=sharded_state.all_part_paths(state) or None,
    )


def load_checkpoint(path: str, state_dir: str | None = None) -> dict[str, Any]:
    """Read a checkpoint, its model whole: where the parameter server's owners wrote it in
    slices (``model_slices``), read from their folders in ``state_dir`` (an agent downloads
    them there) or beside ``path``. Files from before split state existed count as epoch ends.

    Raises FileNotFoundError, or pickle/KeyError/ValueError errors for a file that is not a
    checkpoint or slices that do not make its model.
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    sharded_state.fill_model(state, Path(state_dir) if state_dir else Path(path).parent)
    state.setdefault("epoch_complete", "split" not in state)
    for key in ("split", "rng", "group_optimizers", "optimizer"):
        state.setdefault(key, None)
    state.setdefault("excluded_groups", [])
    return state


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in it (nested dicts, lists, tuples) copied to the CPU, so
    an optimizer state of a CUDA worker unpickles on a host without that device."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def resume_package(state: dict[str, Any]) -> dict[str, Any]:
    """What the workers need from a checkpoint (everything but the model). The optimizer
    state is the replica every worker steps under a replicated strategy (sync)."""
    keep = (
        "epoch",
        "step",
        "epoch_complete",
        "split",
        "rng",
        "group_optimizers",
        "optimizer",
        "excluded_groups",
    )
    return {key: state[key] for key in keep}
