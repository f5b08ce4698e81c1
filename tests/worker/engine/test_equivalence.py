"""Exact gradient averaging: a distributed run equals one process on the same global batches.

Real gloo processes on CPU: a parameter server and two groups (2 + 1
workers). Per-worker batches are unequal (an odd global batch; a weighted
split with one emulated slow group; shares that the online controller
changes mid-epoch), and every step must still be the single-process step on
that step's global batch, to 1e-5. The first two read their shards on the
streaming path (re-planned after every rebalance and exchange; the first with
a DataLoader process per worker reading ahead), the others on the in-memory
path. The parameter server records the global batches it served
(``RunSpec.debug_dump_dir``) for the reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from tests.worker.engine.reference import (
    assert_every_sample_once,
    dumped_batches,
    finite,
    reference_run,
    run_with_dump,
    seeded_batches,
)
from worker.engine.contract import load_training_code
from worker.engine.local import LocalRun
from worker.engine.spec import RunSpec

# Group b at 1/20 of the pace: at a quarter, a loaded host (make test, 2026-11-30, load 9-11)
# slowed the fast workers' profile enough that b's share was not the smallest.
SLOW_B = [
    {"name": "a", "device_type": "cpu", "workers": 2},
    {"name": "b", "device_type": "cpu", "workers": 1, "speed_factor": 0.05},
]
# The streaming data path with one loader process per worker reading ahead.
STREAMING = {"path": "streaming", "num_workers": 1}


def assert_matches_reference(run_spec: RunSpec, dump: Path) -> tuple[LocalRun, list[float]]:
    """Run, then check every rank against the reference on the dumped global batches."""
    run, finals = run_with_dump(run_spec, dump)
    for rank in range(1, 1 + run_spec.n_workers):  # the server's other shards hold none
        assert torch.equal(finals[rank], finals[0]), f"rank {rank} differs from the PS"
    batches = dumped_batches(dump)
    spe = math.ceil(160 / run_spec.global_batch_size)
    assert len(batches) == spe * run_spec.epochs
    full = [b for i, b in enumerate(batches) if (i + 1) % spe]
    assert all(len(b) == run_spec.global_batch_size for b in full), "global batch changed"
    assert_every_sample_once(run_spec, batches)
    expected, epoch_losses = reference_run(run_spec, batches)
    torch.testing.assert_close(finals[0], expected, atol=1e-5, rtol=0)
    return run, epoch_losses


def test_uneven_even_split_with_exchange_equals_one_process(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    # 7 samples over 3 workers: 3 + 2 + 2, each worker streaming its shard through a DataLoader
    spec = make_spec(exchange_fraction=0.25, data=STREAMING)
    run, epoch_losses = assert_matches_reference(spec, tmp_path / "params")
    # The batches an even run serves follow from its seed alone (scripts/netns_check.py
    # replays a task across hosts with them, having no dump).
    seeded = seeded_batches(spec, 160)
    recorded = dumped_batches(tmp_path / "params")
    assert len(seeded) == len(recorded)
    assert all(torch.equal(s, r) for s, r in zip(seeded, recorded, strict=True))
    for got, want in zip(finite(run.metrics("train_loss")), epoch_losses, strict=True):
        assert math.isclose(got, want, rel_tol=1e-5)


def test_weighted_split_with_mid_epoch_rebalancing_equals_one_process(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    spec = make_spec(
        split_policy="weighted",
        groups=SLOW_B,
        global_batch_size=12,
        rebalance_every=3,
        # Read in the rank's own process: a loader process per worker on this 2-core host
        # would make the profiled rates the loaders' and the slow group need not be slowest.
        data={"path": "streaming", "num_workers": 0},
    )
    run, _ = assert_matches_reference(spec, tmp_path / "params")
    shares = [finite(run.metrics("batch_share", rank=r))[0] for r in (1, 2, 3)]
    # The slow group gets less than either fast worker, or the 1-sample floor (on
    # a loaded host a fast worker's profile can put it at the floor too).
    assert shares[2] < min(shares[:2]) or shares[2] == 1 / 12, shares
    assert math.isclose(sum(shares), 1.0)


def test_periodic_sync_in_one_group_is_exact_inside_the_group(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    solo = [{"name": "solo", "device_type": "cpu", "workers": 3}]
    spec = make_spec(groups=solo, sync_strategy="periodic", sync_period=4, global_batch_size=8)
    assert_matches_reference(spec, tmp_path / "params")


def test_reports_checkpoints_and_done(make_spec: Callable[..., RunSpec], tmp_path: Path) -> None:
    spec = make_spec(epochs=1)
    run, finals = run_with_dump(spec, tmp_path / "params")
    kinds = [e["type"] for e in run.events if e["_rank"] == 0]
    assert kinds[-1] == "done"
    # Under sync the parameter server is off the step path: the first worker reports progress.
    progress = [e for e in run.events if e["type"] == "progress"]
    assert progress and {e["_rank"] for e in progress} == {1}
    assert progress[-1]["step"] == math.ceil(160 / 7) and progress[-1]["epoch"] == 0
    paths = [Path(e["path"]) for e in run.events if e["type"] == "checkpoint"]
    assert [p.name for p in paths] == ["epoch-0.pt", "final.pt"]
    state = torch.load(paths[-1], weights_only=True)
    assert state["epoch"] == 0 and state["step"] == math.ceil(160 / 7)
    for name in ("train_loss", "val_loss", "samples_per_s", "epoch_time_s"):
        assert len(run.metrics(name)) == 1, name
    for rank in (1, 2, 3):
        assert len(run.metrics("samples_per_s", rank=rank)) == 1
        assert len(run.metrics("profiled_samples_per_s", rank=rank)) == 1
        assert len(run.metrics("batch_share", rank=rank)) == 2  # at the start, after the epoch
        [idle] = run.metrics("idle_fraction", rank=rank)
        assert 0.0 <= idle < 1.0, idle  # the part of the epoch outside compute sections
    assert "val_accuracy" not in {e.get("name") for e in run.events}
    profiled = [line for line in run.output[0] if "profiled samples/s" in line]
    assert len(profiled) == 1, profiled  # the even split profiles once


USER_METRICS = """
import warnings
import torch
from examples.tiny_regression import build_datasets, build_model, build_optimizer, loss_fn

warnings.warn("user code's own deprecation", FutureWarning)

def metrics(output, target):
    return {"mae": (output - target).abs().mean().item()}
"""


def test_user_metrics_are_reported_as_validation_means(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    module = tmp_path / "with_metrics.py"
    module.write_text(USER_METRICS)
    spec = make_spec(code=str(module), epochs=1, global_batch_size=16)
    run, finals = run_with_dump(spec, tmp_path / "params")
    for rank in run.output:  # the user's warnings show, none from the engine's own calls
        warnings = [line for line in run.output[rank] if "Warning:" in line]
        assert len(warnings) == 1 and "user code's own deprecation" in warnings[0], warnings
    code = load_training_code(spec.code)
    model = code.build_model()
    torch.nn.utils.vector_to_parameters(finals[0], model.parameters())
    inputs, target = code.build_datasets()[1][:]
    with torch.no_grad():
        output = model(inputs)
    assert math.isclose(
        finite(run.metrics("val_mae"))[0], (output - target).abs().mean().item(), rel_tol=1e-5
    )
    assert math.isclose(
        finite(run.metrics("val_loss"))[0], code.loss_fn(output, target).item(), rel_tol=1e-5
    )
