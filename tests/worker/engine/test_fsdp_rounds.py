"""A sharded (``fsdp``) group under ``periodic`` and ``diloco`` (blocking and overlapped): each
of its workers sends the parameter server only its own rows of a round and takes back its
rows of the new model, and the run ends where the same run with the group whole ends, to
1e-5 (the group's step sums by FSDP2's reduce-scatter, not the whole group's allreduce:
the same sums, rounded apart); with the server in 1 or 3 shards it is bitwise the same.

Real gloo processes through the local launcher; a model with BatchNorm buffers
(tests/worker/engine/test_buffers.py), a sharded group of two beside two whole groups, one
of them of two workers (each sends its chunk); checkpoints, whose optimizer state the sharded
group's workers write in rows; a non-finite loss in the group fails or skips its step.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from contracts import sharded_state
from tests.worker.engine.reference import finite, run_with_dump
from tests.worker.engine.test_buffers import bn_spec, checkpoint_model
from tests.worker.engine.test_fsdp import SHARDED_A
from tests.worker.engine.test_numerics import NAN_LOSS, launch, user_spec
from tests.worker.engine.test_ps_shards import STRATEGIES, last_outer_state
from worker.engine.spec import RunSpec

GROUPS = [
    {"name": "a", "device_type": "cpu", "workers": 2},
    {"name": "b", "device_type": "cpu", "workers": 2},
    {"name": "c", "device_type": "cpu", "workers": 1},
]


def _spec(
    make_spec: Callable[..., RunSpec], folder: Path, strategy: str, *, sharded: bool, shards: int
) -> RunSpec:
    groups = [dict(GROUPS[0], sharding="fsdp" if sharded else "none"), *GROUPS[1:]]
    return bn_spec(
        make_spec,
        folder,
        epochs=2,
        ps_shards=shards,
        groups=groups,
        checkpoint_every=6,
        **STRATEGIES[strategy],
    )


# The server in one shard (rank 0 takes every worker's rows and steps the whole outer
# optimizer), in three, and in two.
SHARDS = {"periodic": 3, "diloco": 1, "diloco-overlapped": 2}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_sharded_group_trains_its_rounds_as_the_group_whole(
    make_spec: Callable[..., RunSpec], tmp_path: Path, strategy: str
) -> None:
    whole = _spec(make_spec, tmp_path / "whole", strategy, sharded=False, shards=1)
    sharded = _spec(make_spec, tmp_path / "fsdp", strategy, sharded=True, shards=SHARDS[strategy])
    assert sharded.owner_rounds and not whole.owner_rounds
    _, want = run_with_dump(whole, tmp_path / "whole" / "dump")
    run, got = run_with_dump(sharded, tmp_path / "fsdp" / "dump")
    # Every worker and the server end on the whole run's parameters and buffers.
    for rank in range(1 + whole.n_workers):
        torch.testing.assert_close(got[rank], want[rank], atol=1e-5, rtol=0, msg=str(rank))
    for rank in range(1, 1 + sharded.n_workers):
        assert torch.equal(got[rank], got[0]), rank
    # What a user downloads: the checkpoint's parameters and buffers.
    got_model = checkpoint_model(sharded).state_dict()
    want_model = checkpoint_model(whole).state_dict()
    assert any("running_mean" in name for name in want_model)
    for name, value in want_model.items():
        torch.testing.assert_close(got_model[name], value, atol=1e-5, rtol=0, msg=name)
    # Group a's optimizer state: written by its two workers in rows, each its own file;
    # consolidated, the whole state, as group a's whole run kept it.
    step = torch.load(Path(sharded.checkpoint_dir) / "epoch-0.pt", weights_only=True)
    ref = sharded_state.reference(step["group_optimizers"][0])
    assert ref is not None
    assert ref["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    parts = {
        e["_rank"]
        for e in run.events
        if e["type"] == "checkpoint_part" and ref["folder"] in e["path"]
    }
    assert parts == {1, 2}
    got_state = _group_state(sharded, tmp_path / "got.pt")
    want_state = _group_state(whole, tmp_path / "want.pt")
    assert set(got_state) == set(want_state) != set()
    for key, value in want_state.items():
        torch.testing.assert_close(
            got_state[key]["momentum_buffer"], value["momentum_buffer"], atol=1e-5, rtol=0
        )


def _group_state(spec: RunSpec, out: Path) -> dict:
    """Group a's optimizer state in the last epoch's checkpoint, consolidated as the portal
    builds a download."""
    sharded_state.consolidate(Path(spec.checkpoint_dir) / f"epoch-{spec.epochs - 1}.pt", out)
    return torch.load(out, weights_only=True)["group_optimizers"][0]["state"]


def test_a_sharded_groups_rounds_are_bitwise_alike_on_one_or_three_shards(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    one = _spec(make_spec, tmp_path / "one", "diloco", sharded=True, shards=1)
    three = _spec(make_spec, tmp_path / "three", "diloco", sharded=True, shards=3)
    _, got_one = run_with_dump(one, tmp_path / "one" / "dump")
    _, got_three = run_with_dump(three, tmp_path / "three" / "dump")
    for rank in range(1 + one.n_workers):
        assert torch.equal(got_three[rank], got_one[rank]), rank
    # The outer momentum, one server's SGD state from rank 0 alone or gathered from 3 owners.
    want, got = last_outer_state(one), last_outer_state(three)
    assert want is not None and got is not None
    assert set(got["state"]) == set(want["state"]) != set()
    for key, value in want["state"].items():
        assert torch.equal(got["state"][key]["momentum_buffer"], value["momentum_buffer"]), key


PERIODIC = {"sync_strategy": "periodic", "sync_period": 4}


def test_a_nonfinite_loss_in_a_sharded_periodic_group_fails_the_group_naming_where(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    spec = user_spec(
        make_spec, tmp_path, NAN_LOSS.format(rank=2, step=3), groups=SHARDED_A, **PERIODIC
    )
    run = launch(spec)
    assert not run.ok and not run.timed_out
    for rank in (1, 2):  # both workers of the sharded group fail on the fault itself
        text = run.text(rank).split("NonFiniteError")[-1]
        # rank 1's rows of the group's summed gradient are non-finite too
        assert "loss and gradient on rank 2 (group 'a') at epoch 0, step 3" in text, text
        assert "group 'b'" not in text, text
    assert not any(e["type"] == "checkpoint" for e in run.events)


def test_skip_step_in_a_sharded_periodic_group_skips_it_and_counts(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    source = NAN_LOSS.format(rank=1, step=6)
    spec = user_spec(
        make_spec, tmp_path, source, groups=SHARDED_A, on_nonfinite="skip_step", **PERIODIC
    )
    run, finals = run_with_dump(spec, tmp_path / "dump")
    assert all(torch.isfinite(f).all() for f in finals.values())
    assert all(torch.equal(finals[r], finals[0]) for r in finals)
    assert finite(run.metrics("skipped_steps")) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sync_strategy": "quorum"}, "sync_strategy 'sync', 'periodic', 'diloco', not 'quorum'"),
        (
            {"sync_strategy": "diloco", "sync_period": 4, "diloco_exchange": "async"},
            "diloco_exchange 'blocking' or 'overlapped', not 'async'",
        ),
    ],
)
def test_a_sharded_group_under_a_strategy_without_its_exchange_is_refused(
    make_spec: Callable[..., RunSpec], overrides: dict[str, object], message: str
) -> None:
    groups = [dict(GROUPS[0], sharding="fsdp"), *GROUPS[1:]]
    with pytest.raises(ValueError, match=re.escape(message)):
        make_spec(groups=groups, **overrides)
