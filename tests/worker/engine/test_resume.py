"""Interrupted runs resume exactly: killed after a checkpoint, they end with the same parameters.

Each case runs a task uninterrupted, then runs it again, kills every process
as soon as a given checkpoint is reported, resumes from that checkpoint and
compares the final parameters (and buffers) of every rank. The model has dropout, so the
workers' random state must be restored too; the neighbour exchange and the
weighted split make the split state part of what must be restored.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from contracts import sharded_state
from tests.worker.engine.reference import TIMEOUT_S, run_with_dump
from worker.engine.local import launch_local
from worker.engine.spec import RunSpec

# In the interrupted run (HOLD_AFTER set to the checkpoint it stops at), every rank waits in
# loss_fn from the first call after that checkpoint exists until it is killed: the run cannot
# finish before the kill lands, however fast the host. Waiting changes no number.
HOLD_AFTER = "POLYTRAIN_TEST_HOLD_AFTER"
DROPOUT_MODULE = f"""
import os
import time
from pathlib import Path

from torch import nn
from examples.tiny_regression import build_datasets, build_optimizer
from examples.tiny_regression import loss_fn as mean_squared_error

def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))

def loss_fn(output, target):
    hold = os.environ.get("{HOLD_AFTER}")
    while hold and Path(hold).exists():
        time.sleep(0.05)
    return mean_squared_error(output, target)
"""

# The same with BatchNorm: its running statistics are part of what must resume exactly.
BATCHNORM_MODULE = DROPOUT_MODULE.replace(
    "nn.Tanh(), nn.Dropout(0.2)", "nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.2)"
)

SOLO_EACH = [
    {"name": "fast", "device_type": "cpu", "workers": 1},
    {"name": "slow", "device_type": "cpu", "workers": 1, "speed_factor": 0.05},
]

# Group "a" sharded (FSDP2) beside a whole group "b".
SHARDED_A = [
    {"name": "a", "device_type": "cpu", "workers": 2, "sharding": "fsdp"},
    {"name": "b", "device_type": "cpu", "workers": 1},
]
CASES: dict[str, tuple[dict[str, Any], str]] = {
    # 23 steps per epoch: step 35 is in the middle of epoch 1, after an exchange.
    "sync-even-exchange": ({"exchange_fraction": 0.25, "checkpoint_every": 7}, "step-35.pt"),
    "sync-batchnorm": ({"checkpoint_every": 7}, "step-35.pt"),
    # Group "a" sharded (FSDP2): its two workers write their rows of the momentum into the
    # checkpoint's state folder, and each reads its rows of it back.
    "sync-fsdp": (
        {
            "checkpoint_every": 7,
            "groups": SHARDED_A,
        },
        "step-35.pt",
    ),
    # Periodic sync checkpoints at sync points; this one interrupts at an epoch end.
    "periodic": (
        {
            "sync_strategy": "periodic",
            "sync_period": 4,
            "checkpoint_every": 10,
            "exchange_fraction": 0.1,
        },
        "epoch-0.pt",
    ),
    # With the parameter server in 2 shards, a checkpoint inside the epoch (step 12, the
    # first sync point past 10): rank 0 takes the owners' slices for it.
    "periodic-ps-shards": (
        {"sync_strategy": "periodic", "sync_period": 4, "checkpoint_every": 10, "ps_shards": 2},
        "step-12.pt",
    ),
    # DiLoCo with its default outer Nesterov momentum: rounds end at steps 5, 10, 15, 20, 23
    # of each 23-step epoch; step-33.pt (crossing 30) is the end of epoch 1's second round,
    # with momentum in the outer optimizer and a round position to resume from.
    "diloco": (
        {"sync_strategy": "diloco", "sync_period": 5, "checkpoint_every": 10},
        "step-33.pt",
    ),
    # The same with the parameter server in 3 shards: the outer momentum, gathered from the
    # shards into the checkpoint, goes back to them on resume.
    "diloco-ps-shards": (
        {"sync_strategy": "diloco", "sync_period": 5, "checkpoint_every": 10, "ps_shards": 3},
        "step-33.pt",
    ),
    # Group "a" sharded under periodic and diloco: its workers write their rows of the group's
    # optimizer state into the checkpoint's group folder and read them back, and exchange
    # their own rows of each round (with one shard, with rank 0; the overlapped diloco with
    # 2 shards and its outer momentum).
    "periodic-fsdp": (
        {
            "sync_strategy": "periodic",
            "sync_period": 4,
            "checkpoint_every": 10,
            "groups": SHARDED_A,
        },
        "step-12.pt",
    ),
    "diloco-overlapped-fsdp": (
        {
            "sync_strategy": "diloco",
            "sync_period": 5,
            "checkpoint_every": 10,
            "diloco_exchange": "overlapped",
            "ps_shards": 2,
            "groups": SHARDED_A,
        },
        "step-33.pt",
    ),
    # Overlapped: a checkpoint's round drains the exchange, so the state saved is whole.
    "diloco-overlapped": (
        {
            "sync_strategy": "diloco",
            "sync_period": 5,
            "checkpoint_every": 10,
            "diloco_exchange": "overlapped",
        },
        "step-33.pt",
    ),
    # Async with a checkpoint every round: every round is a barrier, so the run is the same
    # whatever order the groups' updates arrive in, and the delayed Nesterov momentum (in
    # the outer optimizer's state) must come back.
    "diloco-async": (
        {
            "sync_strategy": "diloco",
            "sync_period": 5,
            "checkpoint_every": 5,
            "diloco_exchange": "async",
        },
        "step-33.pt",
    ),
    # The same on the weighted split below: shares 3 + 1, so in a round of 4 global batches the
    # slow worker takes 1 local step and the fast one 3 (steps of the global batch)
    # (step-48.pt: in epoch 1). The slow worker at 1/50 of the pace, so that no load on the
    # host makes the balancer move a sample in one run and not in the other (at 1/20, a
    # clean-clone run on a loaded host, 3 test processes on 2 cores, once ended elsewhere).
    "diloco-weighted": (
        {
            "sync_strategy": "diloco",
            "sync_period": 4,
            "split_policy": "weighted",
            "groups": [
                {"name": "fast", "device_type": "cpu", "workers": 1},
                {"name": "slow", "device_type": "cpu", "workers": 1, "speed_factor": 0.02},
            ],
            "global_batch_size": 4,
            "checkpoint_every": 15,
        },
        "step-48.pt",
    ),
    # B = 4 over a fast and a 20x slower worker: shares 3 + 1 (40 steps per epoch). The
    # resumed run must take the uninterrupted run's rebalancing decisions, which come from
    # measured times: the slow worker's are padded to 20x the pace, the fast one's are
    # real, and the balancer would move a sample only with the slow worker measured at 3/5
    # of the fast one's speed, i.e. the fast one slowed 12x by the host's load (at 10 : 1 a
    # CI run on a loaded host (3 test processes on 2 cores) slowed it past 6x once and the
    # two runs split differently).
    "weighted": (
        {
            "split_policy": "weighted",
            "groups": SOLO_EACH,
            "global_batch_size": 4,
            "checkpoint_every": 15,
            "exchange_fraction": 0.2,
        },
        "step-45.pt",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_resumed_run_ends_with_the_uninterrupted_parameters(
    case: str, make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    overrides, stop_at = CASES[case]
    module = tmp_path / "dropout.py"
    module.write_text(BATCHNORM_MODULE if "batchnorm" in case else DROPOUT_MODULE)
    spec = make_spec(code=str(module), **overrides)
    whole = spec.model_copy(update={"checkpoint_dir": str(tmp_path / "whole")})
    _, expected = run_with_dump(whole, tmp_path / "whole-params")

    def reached(event: dict[str, Any]) -> bool:
        return event["type"] == "checkpoint" and Path(event["path"]).name == stop_at

    hold = {HOLD_AFTER: str(Path(spec.checkpoint_dir) / stop_at)}
    interrupted = launch_local(spec, timeout_s=TIMEOUT_S, stop_when=reached, env_extra=hold)
    assert interrupted.stopped and not any(e["type"] == "done" for e in interrupted.events)
    resumed = spec.model_copy(update={"resume_from": str(Path(spec.checkpoint_dir) / stop_at)})
    run, finals = run_with_dump(resumed, tmp_path / "resumed-params")
    assert any("resumed at epoch" in line for line in run.output[0])
    for rank in range(spec.world_size):
        assert torch.equal(finals[rank], expected[rank]), f"rank {rank} differs after resume"


def test_each_groups_leader_writes_its_optimizer_state_beside_the_checkpoint(
    make_spec: Callable[..., RunSpec],
) -> None:
    """Under diloco (an optimizer per group) the parameter server gathers no group's state:
    each leader writes its own into the checkpoint's state folder for its group, and the
    checkpoint names them; consolidated, as the portal builds a download, each is whole."""
    spec = make_spec(epochs=1, sync_strategy="diloco", sync_period=5)
    run = launch_local(spec, timeout_s=TIMEOUT_S)
    assert run.ok, run.text(0)[-2000:]
    folder = Path(spec.checkpoint_dir)
    saved = torch.load(folder / "epoch-0.pt", weights_only=True)["group_optimizers"]
    assert {g: o["sharded_state"]["folder"] for g, o in saved.items()} == {
        0: "epoch-0.pt.g0.dcp",
        1: "epoch-0.pt.g1.dcp",
    }
    written = {
        (e["_rank"], Path(e["path"]).parent.name)
        for e in run.events
        if e["type"] == "checkpoint_part" and "epoch-0.pt" in e["path"]
    }
    assert written == {(1, "epoch-0.pt.g0.dcp"), (3, "epoch-0.pt.g1.dcp")}  # the leaders
    sharded_state.consolidate(folder / "epoch-0.pt", folder / "whole.pt")
    whole = torch.load(folder / "whole.pt", weights_only=True)
    model = torch.load(folder / "epoch-0.pt", weights_only=True)["model"]
    for state in whole["group_optimizers"].values():
        shapes = [tuple(v.shape) for s in state["state"].values() for v in s.values() if v.dim()]
        assert shapes and set(shapes) <= {tuple(v.shape) for v in model.values()}


@pytest.mark.parametrize("strategy", ["sync", "periodic"])
def test_checkpoint_from_another_layout_continues_or_redoes_its_epoch(
    make_spec: Callable[..., RunSpec], tmp_path: Path, strategy: str
) -> None:
    """On two workers instead of three, a sync checkpoint's epoch goes on from its step
    (tests/worker/engine/test_provenance.py checks the samples and the parameters); a
    periodic one keeps the model and redoes the epoch (its per-group optimizer states do not
    fit other groups; diloco takes the same path, `Strategy.group_optimizers`). Either way
    the step count goes on from the checkpoint."""
    options = {"sync_strategy": strategy, "sync_period": 5} if strategy != "sync" else {}
    first = make_spec(epochs=1, checkpoint_every=5, **options)  # groups of 2 + 1 workers
    stop_at = "step-10.pt"
    launch_local(
        first,
        timeout_s=TIMEOUT_S,
        stop_when=lambda e: e["type"] == "checkpoint" and Path(e["path"]).name == stop_at,
    )
    solo = [{"name": "solo", "device_type": "cpu", "workers": 2}]
    moved = make_spec(
        epochs=2,
        groups=solo,
        checkpoint_dir=str(tmp_path / "moved"),
        resume_from=str(Path(first.checkpoint_dir) / stop_at),
        **options,
    )
    run, _ = run_with_dump(moved, tmp_path / "params")
    output = "\n".join(run.output[0])
    steps = [e["step"] for e in run.events if e["type"] == "checkpoint"]
    assert [e["epoch"] for e in run.events if e["type"] == "checkpoint"][0] == 0
    if strategy == "sync":
        assert "continues epoch 0 at step 10 of 23 on 2 workers" in output
        assert steps[0] == 23, "the epoch ends at its own last step"
    else:
        assert "does not fit this layout" in output
        assert steps[0] == 10 + 23, "the epoch is redone; the step count goes on"
