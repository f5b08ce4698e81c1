"""A parameter server in shards (``ps_shards``) under ``periodic`` and ``diloco`` (blocking and
overlapped): the run is bitwise the unsharded one (every rank's parameters and buffers, the
checkpoint a user downloads and its outer momentum), the other shard owners build no model,
and a spec the engine cannot run is refused naming ``ps_shards``. Under ``sync`` the owners
sum each step's vector in place of the leaders' ring: bitwise alike for any S > 1, and the
ring's result but for the sum's rounding (its equality with one process on the same global
batches: tests/worker/engine/test_equivalence.py).

Real gloo processes through the local launcher; a model with BatchNorm buffers
(tests/worker/engine/test_buffers.py) over three groups, one of two workers (each sends its
own chunk of the group's vector).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.engine.reference import TIMEOUT_S, run_with_dump
from tests.worker.engine.test_buffers import bn_spec, checkpoint_model, downloaded
from tests.worker.engine.test_resume import DROPOUT_MODULE, HOLD_AFTER
from worker.engine.exchange import chunks, shard_bounds
from worker.engine.fsdp import rows_vector
from worker.engine.local import launch_local
from worker.engine.shard_server import clipped, member_spans, within
from worker.engine.spec import RunSpec

STRATEGIES = {
    "periodic": {"sync_strategy": "periodic", "sync_period": 2},
    "diloco": {"sync_strategy": "diloco", "sync_period": 4},
    # rounds of 2 steps: a global model taken one round late is trained on inside the epoch
    "diloco-overlapped": {
        "sync_strategy": "diloco",
        "sync_period": 2,
        "diloco_exchange": "overlapped",
    },
}


# Three groups: each owner adds three groups' slices, whose float sums depend on the order;
# group a's two workers each send their own chunk of its round vector.
GROUPS = [
    {"name": "a", "device_type": "cpu", "workers": 2},
    {"name": "b", "device_type": "cpu", "workers": 1},
    {"name": "c", "device_type": "cpu", "workers": 1},
]


def _spec(make_spec: Callable[..., RunSpec], folder: Path, shards: int, strategy: str) -> RunSpec:
    options = STRATEGIES[strategy]
    return bn_spec(make_spec, folder, epochs=2, ps_shards=shards, groups=GROUPS, **options)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_sharded_server_trains_bitwise_as_one_server(
    make_spec: Callable[..., RunSpec], tmp_path: Path, strategy: str
) -> None:
    one = _spec(make_spec, tmp_path / "one", 1, strategy)
    three = _spec(make_spec, tmp_path / "three", 3, strategy)
    assert (one.world_size, three.world_size) == (5, 7)
    assert three.shard_servers() == [0, 5, 6]
    _, whole = run_with_dump(one, tmp_path / "one" / "dump")
    run, sharded = run_with_dump(three, tmp_path / "three" / "dump")
    # Every rank of the task, server and workers, ends with the same parameters and buffers.
    for rank in range(one.world_size):
        assert whole[rank].numel() > 0
        assert torch.equal(sharded[rank], whole[rank]), rank
    # The other owners hold no model: they built none and dump nothing.
    for rank in (5, 6):
        assert sharded[rank].numel() == 0
        assert f"up: shard {rank - 4} of 3 of the parameter server" in run.text(rank)
    # Rank 0 holds slice 0 only: no checkpoint file holds the parameters, the owners' slices
    # do (each written by its owner, none gathered), and what a user downloads is whole.
    assert "rank 0 keeps slice 0 of the model (" in run.text(0)
    for written in sorted(Path(three.checkpoint_dir).glob("*.pt")):
        saved = torch.load(written, weights_only=True)
        folders = [ref["folder"] for ref in saved["model_slices"]["slices"]]
        assert folders == [f"{written.name}.s{s}.dcp" for s in range(3)], written.name
        assert saved["model"]["1.weight"] == "dcp:float32", written.name
        assert isinstance(saved["model"]["0.running_mean"], torch.Tensor), written.name
    got = checkpoint_model(three).state_dict()
    want = checkpoint_model(one).state_dict()
    assert set(got) == set(want) and any("running_mean" in name for name in got)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    # diloco: the outer momentum, gathered from the shards, as one server's SGD holds it.
    got_outer = last_outer_state(three)
    want_outer = last_outer_state(one)
    assert (got_outer is None) == (strategy == "periodic") == (want_outer is None)
    if want_outer is not None:
        assert got_outer["param_groups"] == want_outer["param_groups"]
        assert set(got_outer["state"]) == set(want_outer["state"]) != set()
        for key, value in want_outer["state"].items():
            assert torch.equal(got_outer["state"][key]["momentum_buffer"], value["momentum_buffer"])


# Sync: a two-worker group (its in-group sum, then each member's chunk) and two of one.
SYNC_GROUPS = [
    {"name": "a", "device_type": "cpu", "workers": 2},
    {"name": "b", "device_type": "cpu", "workers": 1},
    {"name": "c", "device_type": "cpu", "workers": 1},
]


def test_sync_with_a_sharded_server_sums_each_step_alike_for_any_number_of_shards(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    def spec(shards: int) -> RunSpec:
        folder = tmp_path / str(shards)
        return bn_spec(make_spec, folder, epochs=2, ps_shards=shards, groups=SYNC_GROUPS)

    ring, two, three = spec(1), spec(2), spec(3)
    assert three.shard_servers() == [0, 5, 6]
    _, by_ring = run_with_dump(ring, tmp_path / "1" / "dump")
    _, by_two = run_with_dump(two, tmp_path / "2" / "dump")
    run, by_three = run_with_dump(three, tmp_path / "3" / "dump")
    for rank in range(1 + ring.n_workers):  # the server and every worker
        assert by_three[rank].numel() > 0
        # Each element is the same sum in the same order (group order) whatever S.
        assert torch.equal(by_three[rank], by_two[rank]), rank
        # The ring adds three leaders in another order: the same up to the sums' rounding.
        torch.testing.assert_close(by_three[rank], by_ring[rank], atol=1e-5, rtol=1e-5)
        assert torch.equal(by_three[rank], by_three[0]), f"rank {rank} differs from the PS"
    for rank in (5, 6):
        assert by_three[rank].numel() == 0
        assert f"up: shard {rank - 4} of 3 of the parameter server" in run.text(rank)
    got, want = checkpoint_model(three).state_dict(), checkpoint_model(two).state_dict()
    assert any("running_mean" in name for name in got)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_sync_in_one_group_with_a_sharded_server_leaves_the_owners_idle(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    """One group's sum is its own: the owners wait, and the run is bitwise the one-server
    run."""
    group = [{"name": "a", "device_type": "cpu", "workers": 2}]
    one = bn_spec(make_spec, tmp_path / "1", epochs=1, groups=group)
    two = bn_spec(make_spec, tmp_path / "2", epochs=1, groups=group, ps_shards=2)
    _, whole = run_with_dump(one, tmp_path / "1" / "dump")
    run, sharded = run_with_dump(two, tmp_path / "2" / "dump")
    for rank in range(1 + one.n_workers):
        assert torch.equal(sharded[rank], whole[rank]), rank
    assert "up: shard 1 of 2 of the parameter server" in run.text(3)


def last_outer_state(spec: RunSpec) -> dict | None:
    """The last epoch's checkpoint's outer optimizer state."""
    last = sorted(Path(spec.checkpoint_dir).glob("epoch-*.pt"))[-1]
    return downloaded(last).get("outer_optimizer")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sync_strategy": "quorum"}, "ps_shards 2 runs with sync_strategy 'sync' or"),
        ({"sync_strategy": "quorum"}, "not 'quorum' (use ps_shards 1)"),
        (
            {"sync_strategy": "diloco", "sync_period": 4, "diloco_exchange": "async"},
            "not 'async' (use ps_shards 1)",
        ),
    ],
)
def test_a_sharded_server_the_engine_cannot_run_is_refused(
    make_spec: Callable[..., RunSpec], overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        make_spec(ps_shards=2, **overrides)


def test_the_other_owners_are_in_no_group(make_spec: Callable[..., RunSpec]) -> None:
    spec = make_spec(sync_strategy="periodic", ps_shards=2)
    assert spec.world_size == 5 and spec.is_shard_server(4) and not spec.is_shard_server(3)
    with pytest.raises(ValueError, match="rank 4 is the parameter server's"):
        spec.group_of(4)
    with pytest.raises(ValueError, match="ps_shards"):
        make_spec(sync_strategy="periodic", ps_shards=0)


@pytest.mark.parametrize(("written", "read"), [(1, 3), (3, 1)])
def test_a_checkpoint_resumes_on_another_number_of_shards(
    make_spec: Callable[..., RunSpec], tmp_path: Path, written: int, read: int
) -> None:
    """A diloco checkpoint (model and outer momentum, mid-epoch) written with ``written``
    shards resumes with ``read`` and ends bitwise as the uninterrupted run."""
    module = tmp_path / "dropout.py"
    module.write_text(DROPOUT_MODULE)
    options = {"sync_strategy": "diloco", "sync_period": 5, "checkpoint_every": 10}
    spec = make_spec(code=str(module), ps_shards=written, **options)
    whole = spec.model_copy(update={"checkpoint_dir": str(tmp_path / "whole")})
    _, expected = run_with_dump(whole, tmp_path / "whole-params")
    stop_at = Path(spec.checkpoint_dir) / "step-33.pt"

    def reached(event: dict[str, Any]) -> bool:
        return event["type"] == "checkpoint" and Path(event["path"]) == stop_at

    hold = {HOLD_AFTER: str(stop_at)}
    interrupted = launch_local(spec, timeout_s=TIMEOUT_S, stop_when=reached, env_extra=hold)
    assert interrupted.stopped
    outer = torch.load(stop_at, weights_only=False)["outer_optimizer"]
    assert outer["state"], "no outer momentum in the checkpoint"
    # As an agent lays out a resume: the file apart, its state folders in a folder of their
    # own (the model's slices, read by rank 0, where the owners wrote them).
    downloaded = tmp_path / "agent" / "resume-9.state"
    for folder in Path(spec.checkpoint_dir).glob("step-33.pt.*.dcp"):
        shutil.copytree(folder, downloaded / folder.name)
    slices = sorted(f.name for f in downloaded.glob("*.s*.dcp"))
    assert slices == ([f"step-33.pt.s{s}.dcp" for s in range(written)] if written > 1 else [])
    resume_file = shutil.copy(stop_at, tmp_path / "agent" / "resume-9.pt")
    resumed = make_spec(
        code=str(module),
        ps_shards=read,
        resume_from=str(resume_file),
        resume_state_dir=str(downloaded),
        **options,
    )
    run, finals = run_with_dump(resumed, tmp_path / "resumed-params")
    assert any("resumed at epoch" in line for line in run.output[0])
    for rank in range(1 + spec.n_workers):  # the parameter server and every worker
        assert torch.equal(finals[rank], expected[rank]), f"rank {rank} differs after resume"


def test_a_whole_groups_chunks_cover_the_vector_once_and_may_be_empty() -> None:
    assert chunks(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunks(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]  # more members than elements


@pytest.mark.parametrize("members", [1, 2, 3, 5])
def test_a_members_spans_are_its_rows_of_the_flat_parameters(members: int) -> None:
    """What a sharded worker sends the owners: its rows as worker.engine.fsdp lays them end to
    end (``rows_vector``, on the same ``row_layout``: FSDP2's own split is checked end to end
    by tests/worker/engine/test_fsdp.py) are the flat vector's elements in its spans, and the
    part inside an owner's slice is one contiguous run of them."""
    shapes = [(7, 3), (7,), (), (2, 2, 2), (1, 5), (4,)]
    params = [torch.randn(shape) for shape in shapes]
    flat = torch.cat([p.reshape(-1) for p in params])
    spans = member_spans(shapes, members)
    covered = sorted(span for mine in spans for span in mine)
    assert covered[0][0] == 0 and covered[-1][1] == flat.numel()
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))  # no gap
    for member, mine in enumerate(spans):
        rows = rows_vector(params, member, members)
        assert torch.equal(rows, torch.cat([flat[a:b] for a, b in mine] or [flat[:0]]))
        for lo, hi in shard_bounds(flat.numel(), 4):
            a, b = within(mine, lo, hi)
            inside = [flat[lo + x : lo + y] for x, y in clipped(mine, lo, hi)]
            assert torch.equal(rows[a:b], torch.cat(inside or [flat[:0]]))


def test_a_resume_that_changes_the_outer_settings_uses_them_with_or_without_shards(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    """A diloco checkpoint resumed with another ``outer_lr`` and ``outer_momentum``: one
    server and three shards both take the checkpoint's momentum and the new settings, so
    they end bitwise alike (the one server used to keep the checkpoint's settings)."""
    module = tmp_path / "dropout.py"
    module.write_text(DROPOUT_MODULE)
    options = {"sync_strategy": "diloco", "sync_period": 5, "checkpoint_every": 10}
    spec = make_spec(code=str(module), **options)
    stop_at = Path(spec.checkpoint_dir) / "step-33.pt"

    def reached(event: dict[str, Any]) -> bool:
        return event["type"] == "checkpoint" and Path(event["path"]) == stop_at

    hold = {HOLD_AFTER: str(stop_at)}
    assert launch_local(spec, timeout_s=TIMEOUT_S, stop_when=reached, env_extra=hold).stopped
    finals = []
    for shards in (1, 3):
        folder = tmp_path / f"resumed-{shards}"
        resumed = make_spec(
            code=str(module),
            ps_shards=shards,
            resume_from=str(stop_at),
            **{**options, "outer_lr": 0.5, "outer_momentum": 0.5},
            checkpoint_dir=str(folder / "checkpoints"),
        )
        finals.append(run_with_dump(resumed, folder / "params")[1])
    for rank in range(1 + spec.n_workers):
        assert torch.equal(finals[0][rank], finals[1][rank]), f"rank {rank}"
