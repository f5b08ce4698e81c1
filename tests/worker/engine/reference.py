"""Single-process references for the distributed runs, and helpers to run and read them."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from worker.engine import prefork
from worker.engine.contract import load_training_code, seed_everything
from worker.engine.local import LocalRun, launch_local
from worker.engine.sharding import even_shares
from worker.engine.spec import RunSpec
from worker.engine.split import SplitState

TIMEOUT_S = 90.0


def reference_run(spec: RunSpec, batches: list[torch.Tensor]) -> tuple[torch.Tensor, list[float]]:
    """Train one process on ``batches`` (index tensors, in order) with the task's code.

    Returns the final parameters [P] and the batch-size-weighted mean loss of
    each ``steps_per_epoch`` run of batches.
    """
    model, epoch_losses = reference_model(spec, batches)
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), epoch_losses


def reference_model(
    spec: RunSpec, batches: list[torch.Tensor]
) -> tuple[torch.nn.Module, list[float]]:
    """:func:`reference_run`'s training; returns the trained model (buffers included)."""
    code = load_training_code(spec.code)
    seed_everything(spec.seed)
    model = code.build_model()
    seed_everything(spec.seed)
    train_set, _ = code.build_datasets()
    optimizer = code.build_optimizer(model.parameters())
    losses, samples = [], []
    for batch in batches:
        inputs, target = default_collate([train_set[int(i)] for i in batch])
        loss = code.loss_fn(model(inputs), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item() * len(batch))
        samples.append(len(batch))
    spe = -(-len(train_set) // spec.global_batch_size)
    epoch_losses = [
        sum(losses[i : i + spe]) / sum(samples[i : i + spe]) for i in range(0, len(losses), spe)
    ]
    return model, epoch_losses


def seeded_batches(spec: RunSpec, n_items: int) -> list[torch.Tensor]:
    """Every step's global batch (index tensors, in order) of a fresh ``even`` run, derived
    without running it: the split is a pure function of the seed, the epoch and the shares,
    walked as :func:`worker.engine.session.train` does (initial shards, then per epoch
    ``begin_epoch``, the steps, the neighbour exchange)."""
    workers = sum(g.workers for g in spec.groups)
    split = SplitState.initial(n_items, even_shares(spec.global_batch_size, workers), spec.seed)
    batches = []
    for epoch in range(spec.epochs):
        split.begin_epoch(spec.seed, epoch)
        while not split.epoch_done:
            batches.append(split.global_batch())
            split.advance()
        split.exchange(spec.exchange_fraction, spec.seed, epoch)
    return batches


def run_with_dump(
    spec: RunSpec, dump_dir: Path, **kwargs: object
) -> tuple[LocalRun, dict[int, torch.Tensor]]:
    """Run ``spec`` locally, saving each rank's final parameters (and the PS's batches)."""
    spec = spec.model_copy(update={"debug_dump_dir": str(dump_dir)})
    run = launch_local(spec, timeout_s=TIMEOUT_S, **kwargs)  # type: ignore[arg-type]
    assert run.ok, "\n".join(run.text(r) for r in run.output)
    return run, {r: torch.load(dump_dir / f"rank-{r}.pt") for r in range(spec.world_size)}


def dumped_batches(dump_dir: Path) -> list[torch.Tensor]:
    """The global batches the parameter server recorded (``RunSpec.debug_dump_dir``)."""
    return torch.load(dump_dir / "batches.pt")


def assert_every_sample_once(
    spec: RunSpec, batches: list[torch.Tensor], n_items: int = 160
) -> None:
    """Each epoch's dumped global batches take every one of the ``n_items`` training items
    exactly once."""
    steps = math.ceil(n_items / spec.global_batch_size)
    for epoch in range(spec.epochs):
        seen = torch.cat(batches[epoch * steps : (epoch + 1) * steps])
        assert torch.equal(seen.sort().values, torch.arange(n_items)), "not every sample once"


def finite(values: list[float | None]) -> list[float]:
    """The metric values, asserting none was reported as non-finite (null)."""
    assert all(v is not None for v in values), values
    return [v for v in values if v is not None]


def run_ranks(target: Callable[..., None], world_size: int, *args: Any) -> list[int | None]:
    """Run ``target(rank, *args)`` for every rank of ``world_size`` in processes forked from
    one server that imported torch and ``target``'s module once (a spawned interpreter would
    import them again, seconds each: the server launch_local's ranks fork from too,
    tests/conftest.py); returns their exit codes, None for one still running after 120 s."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([*prefork.PRELOAD, target.__module__])
    procs = [context.Process(target=target, args=(rank, *args)) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    return [proc.exitcode for proc in procs]


def leave_with_record(out: str, rank: int, record: dict[str, Any]) -> None:
    """End a forked rank of :func:`run_ranks`: write its ``record`` to ``rank-<rank>.json``
    in ``out``, leave the process group and exit 0 at once (no interpreter teardown, where
    gloo's threads could still hold work)."""
    Path(out, f"rank-{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    os._exit(0)
