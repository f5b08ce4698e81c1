"""The parameter-server side (rank 0): global model, the user's optimizer, reports, checkpoints.

The update rule belongs to the sync strategy
(:class:`worker.engine.strategy.Strategy`: ``sync`` every step, ``periodic``
model averaging, ``quorum`` Z-of-M); see
:mod:`worker.engine.session` for the order of a run. The parameter server
also owns the load balancer and writes every checkpoint
(:mod:`worker.engine.checkpoint`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from contracts import sharded_state
from worker.engine import report, session, shard_server
from worker.engine.checkpoint import load_checkpoint, resume_package, save_checkpoint
from worker.engine.contract import TrainingCode
from worker.engine.data import DataSources
from worker.engine.distributed import Topology
from worker.engine.fsdp import return_freed_memory
from worker.engine.run import Run, saved_model
from worker.engine.spec import RunSpec


def report_server_epoch(run: Run, results: dict[str, Any], seconds: float) -> None:
    """Task-level metrics of one epoch (rank 0).

    ``train_loss`` (mean over the epoch's samples), ``samples_per_s`` (samples
    / training seconds), ``epoch_time_s`` (seconds of the epoch's steps,
    without validation), ``epoch_wall_s`` (seconds from the previous epoch's report, or the
    start of training, to this one's: the steps, the epoch's end and validation, and the
    previous epoch's checkpoint, all that a user waits for an epoch), every ``val_*`` mean,
    for quorum sync ``updates`` and ``max_staleness``, and with ``on_nonfinite: skip_step``
    ``skipped_steps`` (optimizer steps skipped in the epoch, summed over the
    groups' optimizers with periodic and quorum sync). Skipped steps' samples
    are left out of ``train_loss`` and ``samples_per_s``. Unless ``on_disagreement`` is
    ``off``, ``agreement_check_s``: wall seconds the cross-device agreement checks took so
    far in this attempt (:mod:`worker.engine.agreement`; the check before training included).
    """
    values = {
        "train_loss": run.loss_sum / run.samples if run.samples else math.nan,
        "samples_per_s": run.samples / seconds if seconds > 0 else 0.0,
        "epoch_time_s": seconds,
        "epoch_wall_s": results["epoch_wall_s"],
        **run.stats,
    }
    if run.spec.on_nonfinite == "skip_step":
        values["skipped_steps"] = float(results["skipped_steps"])
    if run.spec.on_disagreement != "off":
        values["agreement_check_s"] = run.agreement_s
    values.update({name: s / n if n else math.nan for name, (s, n) in results["val"].items()})
    for name, value in values.items():
        report.metric(name, value, step=run.step, epoch=run.epoch, rank=0)
    summary = ", ".join(f"{k} {v:.4g}" for k, v in values.items())
    report.log(f"epoch {run.epoch}: {summary}; shares {run.split.shares}")


def _dump_batches(run: Run) -> None:
    """Save the recorded global batches to ``batches.pt`` in ``spec.debug_dump_dir``."""
    directory = run.spec.debug_dump_dir
    if directory and run.batches is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save(run.batches, Path(directory) / "batches.pt")


def run_parameter_server(
    spec: RunSpec,
    code: TrainingCode,
    topo: Topology,
    model: torch.nn.Module,
    data: DataSources,
    clock: report.StartupClock | None = None,
) -> Tensor:
    """Run rank 0 until the last epoch: returns the final parameters and buffers [P + B] where
    ``spec.debug_dump_dir`` is set, else an empty tensor.

    Writes the checkpoints of :mod:`worker.engine.checkpoint` and ``final.pt``
    in ``spec.checkpoint_dir``, then reports ``done``; with ``spec.debug_dump_dir``
    it saves every step's global batch indices there too (``batches.pt``).
    Raises whatever the user's optimizer raises, FileNotFoundError for a
    missing ``resume_from``.
    """
    model.to("cpu")
    if spec.any_sharded:  # it assembles each checkpoint's state from rows, then frees it
        return_freed_memory()
    optimizer = code.build_optimizer(model.parameters())
    package, outer_state = None, None
    if spec.resume_from:
        state = load_checkpoint(spec.resume_from, spec.resume_state_dir)
        model.load_state_dict(state["model"])
        # The server never steps the workers' optimizer: their state stays in its folder
        # (a checkpoint from before state folders holds it whole).
        held_out = sharded_state.reference(state["optimizer"]) is not None
        if state["optimizer"] is not None and not held_out:
            optimizer.load_state_dict(state["optimizer"])
        package = resume_package(state)
        outer_state = state.get("outer_optimizer")  # diloco's outer momentum stays here
    run, under_way = session.start(spec, code, topo, model, optimizer, data, package, clock)
    run.outer_state = outer_state
    resumed = None
    if package is not None and sharded_state.reference(package["optimizer"]) is not None:
        resumed = run.optimizer_in = package["optimizer"]  # not loaded above
    if spec.debug_dump_dir:
        run.batches = []
    session.train(run, under_way, lambda r: {}, report_server_epoch)
    # Under sync the optimizer replica is in the last checkpoint's state folder (run.py):
    # final.pt names that folder, the state being the same.
    directory = Path(spec.checkpoint_dir)
    held: dict[str, Any] | None = (
        run.optimizer_in if run.optimizer_in is not None else optimizer.state_dict()
    )
    if resumed is not None and run.optimizer_in is resumed:
        # No checkpoint since the resume: the folder is the resumed one's, not beside final.pt.
        held = None
        report.log("final.pt holds no optimizer state: none was trained after the resume")
    final = {
        **saved_model(run, "final.pt"),
        "optimizer": held,
        "epoch": spec.epochs - 1,
        "step": run.step,
        "epoch_complete": True,
    }
    if topo.shards is not None:
        shard_server.stop(topo)
    save_checkpoint(directory / "final.pt", final)
    _dump_batches(run)
    report.done()
    if not spec.debug_dump_dir:
        return torch.empty(0)
    if sharded_state.MODEL_SLICES in final:  # rank 0 holds slice 0: the model as written
        written = load_checkpoint(str(directory / "final.pt"))["model"]
        for name, param in model.named_parameters():
            param.data = written[name]
    return run.state.vector()
