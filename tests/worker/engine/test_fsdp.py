"""Sharding inside a group (``sharding: fsdp``, worker/engine/fsdp.py): each worker of a
sharded group holds its rows of the model, and a step is still the single-process step on
the step's global batch, to 1e-5.

Real gloo processes on CPU. The cases: a sharded group of 2 beside an unsharded group of one
emulated slow worker on the weighted split, rebalanced mid-epoch; two sharded groups of 3 and
2 workers (the tiny model's output layer has one row, so some workers hold none of it) on an
odd global batch; BatchNorm's buffers in a sharded group, by the documented rule. Every run
checks the parameters' agreement every few steps and checkpoints mid-epoch, which gather the
sharded replica at the parameter server.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from contracts import sharded_state
from tests.worker.engine.reference import (
    TIMEOUT_S,
    assert_every_sample_once,
    dumped_batches,
    finite,
    reference_run,
    run_with_dump,
)
from tests.worker.engine.test_buffers import ATOL, bn_spec, checkpoint_model, rule_reference
from tests.worker.engine.test_numerics import NAN_LOSS, launch, user_spec
from tests.worker.engine.test_provenance import covers_once, provenance_of
from worker.engine import prefork
from worker.engine.fsdp import ShardingError, chunk_rows, named_units, shard_model, size_units
from worker.engine.local import launch_local
from worker.engine.ranks import jemalloc_path
from worker.engine.sharded import is_sharded, local
from worker.engine.spec import RunSpec

CASES = {
    "sharded-beside-whole-weighted": {
        "groups": [
            {"name": "a", "device_type": "cpu", "workers": 2, "sharding": "fsdp"},
            {"name": "b", "device_type": "cpu", "workers": 1, "speed_factor": 0.25},
        ],
        "split_policy": "weighted",
        "rebalance_every": 3,
        "global_batch_size": 8,
    },
    "two-sharded-groups-3-and-2": {
        "groups": [
            {"name": "a", "device_type": "cpu", "workers": 3},
            {"name": "b", "device_type": "cpu", "workers": 2},
        ],
        "sharding": "fsdp",
        "global_batch_size": 7,
    },
}
# The parameter server in shards sums the groups' gradients: each sharded worker sends its
# own rows to the owners of the slices they fall in (worker.engine.shard_server.RowSum).
CASES["sharded-beside-whole-weighted-3-ps-shards"] = {
    **CASES["sharded-beside-whole-weighted"],
    "ps_shards": 3,
}
CASES["sharded-beside-whole-of-2-2-ps-shards"] = {  # the whole group's members send chunks
    "groups": [
        {"name": "a", "device_type": "cpu", "workers": 2, "sharding": "fsdp"},
        {"name": "b", "device_type": "cpu", "workers": 2},
    ],
    "global_batch_size": 8,
    "ps_shards": 2,
}
CASES["two-sharded-groups-3-and-2-2-ps-shards"] = {
    **CASES["two-sharded-groups-3-and-2"],
    "ps_shards": 2,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_groups_step_as_one_process(
    case: str, make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    spec = make_spec(agreement_every=4, checkpoint_every=6, **CASES[case])
    run, finals = run_with_dump(spec, tmp_path / "params")
    for rank in range(1, 1 + spec.n_workers):  # the server's other shards hold no model
        assert torch.equal(finals[rank], finals[0]), f"rank {rank} differs from the PS"
    batches = dumped_batches(tmp_path / "params")
    assert_every_sample_once(spec, batches)
    expected, _ = reference_run(spec, batches)
    torch.testing.assert_close(finals[0], expected, atol=1e-5, rtol=0)
    # The agreement checks (before training, then every 4 steps) passed: a disagreement
    # fails the run (on_disagreement: fail), which run_with_dump asserts against.
    assert (Path(spec.checkpoint_dir) / "step-6.pt").exists()
    # The source group (a) is sharded: final.pt names the last epoch's state folder, which
    # its workers wrote (the parameter server, which never steps under sync, holds none of
    # it); consolidated, as the portal builds a download, it is the whole optimizer state.
    final_pt = Path(spec.checkpoint_dir) / "final.pt"
    final = torch.load(final_pt, weights_only=True)
    ref = sharded_state.reference(final["optimizer"])
    assert ref is not None and ref["folder"] == f"epoch-{spec.epochs - 1}.pt.dcp"
    whole = tmp_path / "final-whole.pt"
    sharded_state.consolidate(final_pt, whole)
    final = torch.load(whole, weights_only=True)
    shapes = [tuple(t.shape) for t in final["model"].values()]
    momenta = [tuple(s["momentum_buffer"].shape) for s in final["optimizer"]["state"].values()]
    assert momenta == shapes
    # The checkpoints' shard provenance: each epoch's records cover every sample once.
    records = provenance_of(run.events)
    for epoch in range(spec.epochs):
        assert covers_once([r for r in records if r["epoch"] == epoch], 160), epoch


def test_buffers_of_a_sharded_group_follow_the_rule(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    groups = [{"name": "a", "device_type": "cpu", "workers": 3}]
    spec = bn_spec(make_spec, tmp_path, groups=groups, sharding="fsdp")
    _, finals = run_with_dump(spec, tmp_path / "dump")
    for rank in range(1, spec.world_size):  # parameters and buffers, [P + B]
        assert torch.equal(finals[rank], finals[0]), f"rank {rank} differs from the PS"
    got = checkpoint_model(spec).state_dict()
    rule = rule_reference(spec, dumped_batches(tmp_path / "dump")).state_dict()
    assert float(got["0.running_mean"][-1]) > 3.0, got["0.running_mean"]
    for name, want in rule.items():
        torch.testing.assert_close(got[name], want, atol=ATOL, rtol=0, msg=name)


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.inner(x))


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(Block(32), Block(32), torch.nn.Linear(32, 2))


def test_units_by_size_and_by_name() -> None:
    model = _model()
    # Each block holds 1056 of 2178 parameters (>= 1/32): a unit; the 66-parameter head (< 1/32) is
    # left to the root.
    assert size_units(model) == [model[0].inner, model[1].inner]
    assert named_units(model, ["Block"]) == [model[1], model[0]]
    with pytest.raises(ShardingError, match=r"fsdp_units names \['Blok'\].*'Block'"):
        named_units(model, ["Blok"])
    assert chunk_rows(7, 2) == [4, 3] and chunk_rows(1, 3) == [1, 0, 0]


def _shard_in_world(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from worker.engine.distributed import Topology

    group = dist.new_group([0, 1])
    topo = Topology(
        rank=rank,
        world_size=2,
        n_workers=2,
        group_index=0,
        group=group,
        group_ranks=(0, 1),
        device=torch.device("cpu"),
    )
    torch.manual_seed(0)
    model = shard_model(_model(), topo, ["Block"])
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    held = sum(local(p).numel() for p in model.parameters())
    state = sum(
        local(v).numel()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    sharded = all(is_sharded(p) for p in model.parameters())
    torch.save({"held": held, "state": state, "sharded": sharded}, f"{out}/rank-{rank}.pt")
    dist.destroy_process_group()


def test_each_member_holds_its_rows_of_parameters_and_optimizer_state(tmp_path: Path) -> None:
    port = 29000 + os.getpid() % 1000
    mp.spawn(_shard_in_world, args=(port, str(tmp_path)), nprocs=2)
    total = sum(p.numel() for p in _model().parameters())  # 2178
    found = [torch.load(tmp_path / f"rank-{r}.pt") for r in range(2)]
    assert all(f["sharded"] for f in found)
    assert sum(f["held"] for f in found) == total
    for f in found:
        assert f["held"] <= total / 2 + 32  # half of each parameter's rows, rounded up
        assert f["state"] == 2 * f["held"]  # Adam's two moments, of its rows only


def test_a_sharded_checkpoint_resumes_on_another_number_of_workers(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    """A checkpoint taken mid-epoch with group "a" sharded over 2 workers goes on with one
    group of 4 sharded workers (each takes its rows of the model and of the optimizer's
    momentum; the output layer's one row is on the first only): it ends where the same
    resume on 4 whole replicas ends.

    The optimizer state is never gathered: each of group a's workers writes its rows into
    the checkpoint's state folder (torch.distributed.checkpoint), and reports the files it
    wrote; the checkpoint file keeps only the state's outline, naming them."""
    first = make_spec(
        epochs=1,
        checkpoint_every=5,
        groups=[
            {"name": "a", "device_type": "cpu", "workers": 2, "sharding": "fsdp"},
            {"name": "b", "device_type": "cpu", "workers": 1},
        ],
    )
    stop_at = "step-10.pt"
    ran = launch_local(
        first,
        timeout_s=TIMEOUT_S,
        stop_when=lambda e: e["type"] == "checkpoint" and Path(e["path"]).name == stop_at,
    )
    saved = torch.load(Path(first.checkpoint_dir) / stop_at, weights_only=True)["optimizer"]
    files = [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert saved["sharded_state"] == {"folder": "step-10.pt.dcp", "files": files}
    kept = [v for s in saved["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert all(v.dim() == 0 for v in kept)  # scalars only: the state tensors are marked
    assert {v for s in saved["state"].values() for v in s.values() if isinstance(v, str)} == {
        "dcp:float32"
    }
    folder = Path(first.checkpoint_dir) / "step-10.pt.dcp"
    assert sorted(p.name for p in folder.iterdir()) == files
    parts = {
        (e["_rank"], Path(e["path"]).name)
        for e in ran.events
        if e["type"] == "checkpoint_part" and Path(e["path"]).parent == folder
    }
    assert parts == {(1, ".metadata"), (1, "__0_0.distcp"), (2, "__1_0.distcp")}
    told = [e for e in ran.events if e["type"] == "checkpoint" and e["path"].endswith(stop_at)]
    assert told[0]["parts"] == [f"step-10.pt.dcp/{f}" for f in files]
    finals = {}
    fetched = None
    for sharding in ("none", "fsdp"):
        if sharding == "fsdp":  # as an agent's worker: the folder downloaded into its own
            fetched = str(tmp_path / "resume-9.state")
            Path(fetched).mkdir()
            folder.rename(Path(fetched) / folder.name)
        moved = make_spec(
            epochs=2,
            groups=[{"name": "solo", "device_type": "cpu", "workers": 4}],
            sharding=sharding,
            checkpoint_dir=str(tmp_path / sharding),
            resume_from=str(Path(first.checkpoint_dir) / stop_at),
            resume_state_dir=fetched,
        )
        run, finals[sharding] = run_with_dump(moved, tmp_path / f"params-{sharding}")
        assert "continues epoch 0 at step 10 of 23 on 4 workers" in "\n".join(run.output[0])
    torch.testing.assert_close(finals["fsdp"][0], finals["none"][0], atol=1e-5, rtol=0)


def test_a_sharded_group_that_cannot_write_its_state_fails_the_task_at_once(
    make_spec: Callable[..., RunSpec],
) -> None:
    """The state folder cannot be made (a file is in its place): group a's workers fail
    their write alike, and the parameter server fails the task naming it, then and there,
    not at the process group's timeout (120 s, past this test's 90)."""
    spec = make_spec(epochs=1, checkpoint_every=6, groups=SHARDED_A)
    Path(spec.checkpoint_dir).mkdir(parents=True)
    (Path(spec.checkpoint_dir) / "step-6.pt.dcp").write_text("not a folder")
    run = launch_local(spec, timeout_s=TIMEOUT_S)
    assert not run.timed_out and run.returncodes[0] != 0, run.returncodes
    for rank in run.output:  # every rank ends on the reason, none on a lost peer
        said = run.text(rank)
        reason = "rank 1 could not write its optimizer state for step-6.pt: FileExistsError"
        assert reason in said and "step-6.pt.dcp" in said, said[-3000:]


def test_fsdp_units_naming_no_module_class_fails_the_task_naming_the_field(
    make_spec: Callable[..., RunSpec],
) -> None:
    spec = make_spec(
        groups=[{"name": "a", "device_type": "cpu", "workers": 2}],
        sharding="fsdp",
        fsdp_units=["TransformerBlock"],
    )
    run = launch_local(spec, timeout_s=TIMEOUT_S)
    assert not run.ok
    said = "\n".join(run.text(r) for r in run.output)
    assert "fsdp_units names ['TransformerBlock']" in said and "'Linear'" in said


SHARDED_A = [
    {"name": "a", "device_type": "cpu", "workers": 2, "sharding": "fsdp"},
    {"name": "b", "device_type": "cpu", "workers": 1},
]


def test_a_nonfinite_loss_in_a_sharded_group_fails_every_rank_naming_where(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    source = NAN_LOSS.format(rank=2, step=5)
    spec = user_spec(make_spec, tmp_path, source, groups=SHARDED_A, checkpoint_every=2)
    run = launch(spec)
    assert not run.timed_out and all(c == 1 for c in run.returncodes.values()), run.returncodes
    for rank in run.output:  # every rank fails on the fault itself, not on a lost peer
        text = run.text(rank)
        assert "NonFiniteError: non-finite" in text and "at epoch 0, step 5" in text, text
        # Group a's summed gradient is non-finite on both its workers; group b's is not.
        assert "loss and gradient on rank 2 (group 'a')" in text, text
        assert "group 'b'" not in text.split("NonFiniteError")[-1], text
    assert [e["step"] for e in run.events if e["type"] == "checkpoint"] == [2, 4]


def test_skip_step_in_a_sharded_group_skips_everywhere(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    source = NAN_LOSS.format(rank=1, step=4)
    spec = user_spec(make_spec, tmp_path, source, groups=SHARDED_A, on_nonfinite="skip_step")
    run, finals = run_with_dump(spec, tmp_path / "dump")
    assert all(torch.equal(finals[r], finals[0]) for r in finals)
    assert all(torch.isfinite(finals[0]))
    assert finite(run.metrics("skipped_steps")) == [1.0, 0.0]


# Weight decay on matrices only: the optimizer's groups number its parameters in another
# order than the model's (its state and a checkpoint's follow the optimizer's numbering).
PARAM_GROUPS = """
import torch
from examples.tiny_regression import build_datasets, build_model, loss_fn

def build_optimizer(params):
    params = list(params)
    decay = [p for p in params if p.dim() > 1]
    rest = [p for p in params if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest}]
    return torch.optim.SGD(groups, lr=0.02, momentum=0.9)
"""
# The first layer frozen, with weight decay: it must not move.
FROZEN = """
import torch
from torch import nn
from examples.tiny_regression import build_datasets, loss_fn

def build_model():
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model

def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.02, momentum=0.9, weight_decay=0.1)
"""


@pytest.mark.parametrize(
    ("source", "ps_shards"),
    [(PARAM_GROUPS, 1), (FROZEN, 1), (FROZEN, 2)],
    ids=["param-groups", "frozen", "frozen-2-ps-shards"],
)
def test_optimizer_groups_and_frozen_parameters_step_as_one_process(
    source: str, ps_shards: int, make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    module = tmp_path / "user_code.py"
    module.write_text(source)
    spec = make_spec(code=str(module), groups=SHARDED_A, checkpoint_every=6, ps_shards=ps_shards)
    _, finals = run_with_dump(spec, tmp_path / "params")
    expected, _ = reference_run(spec, dumped_batches(tmp_path / "params"))
    torch.testing.assert_close(finals[0], expected, atol=1e-5, rtol=0)


def test_bfloat16_mixed_precision_computes_low_and_keeps_float32(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    # fsdp_param_dtype bfloat16: the sharded group's forward and backward in bfloat16 (FSDP2's
    # MixedPrecisionPolicy), its gradients reduced and its optimizer stepped in float32. The
    # result is near the float32 single-process run but not equal to it, every rank agrees,
    # and the agreement checks (every 4 steps, on_disagreement: fail) pass at bfloat16's
    # tolerance, where float32's cpu/cpu tolerance (0) would fail the task.
    spec = make_spec(
        agreement_every=4,
        fsdp_param_dtype="bfloat16",
        **CASES["sharded-beside-whole-weighted"],
    )
    run, finals = run_with_dump(spec, tmp_path / "params")
    for rank in range(1, spec.world_size):
        assert torch.equal(finals[rank], finals[0]), f"rank {rank} differs from the PS"
    assert finals[0].dtype == torch.float32
    expected, _ = reference_run(spec, dumped_batches(tmp_path / "params"))
    gap = float((finals[0] - expected).norm() / expected.norm())
    assert 1e-6 < gap < 2e-2, gap


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(
    jemalloc_path({"POLYTRAIN_JEMALLOC": "on"}) is None,
    reason="no jemalloc on this host (Debian: libjemalloc2)",
)
def test_on_request_sharded_workers_start_with_jemalloc_and_the_others_do_not(
    make_spec: Callable[..., RunSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A sharded worker frees and allocates every unit's gather each step; jemalloc reuses the
    # pages where glibc, as the engine sets it, maps them afresh each step. The library must
    # be preloaded when the interpreter starts, so these ranks start fresh.
    monkeypatch.setenv("POLYTRAIN_JEMALLOC", "on")
    spec = make_spec(**CASES["sharded-beside-whole-weighted"])
    seen: dict[int, bool] = {}

    def look(pids: dict[int, int]) -> None:
        for rank, pid in pids.items():  # the loader maps LD_PRELOAD before libc, at exec
            deadline = time.monotonic() + 30
            while "libc.so" not in _maps(pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            seen[rank] = "libjemalloc" in _maps(pid)

    with prefork.disabled():
        run = launch_local(spec, timeout_s=150, on_spawn=look)
    assert run.ok, run.text(1)[-3000:]
    assert seen == {0: False, 1: True, 2: True, 3: False}  # the server, a (fsdp) x 2, b
    said = [line for line in run.output[1] if "group a:" in line]
    assert len(said) == 1 and "run on jemalloc" in said[0], said  # the leader says which


def test_without_jemalloc_a_sharded_group_says_what_it_costs(
    make_spec: Callable[..., RunSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    # By default glibc's malloc with the fixed mmap threshold, and one line from the group's
    # leader that says so and what the other choice would give.
    monkeypatch.delenv("POLYTRAIN_JEMALLOC", raising=False)
    spec = make_spec(**CASES["sharded-beside-whole-weighted"], epochs=1)
    run = launch_local(spec, timeout_s=150)
    assert run.ok, run.text(1)[-3000:]
    said = [r for r, out in run.output.items() if any("POLYTRAIN_JEMALLOC=on" in x for x in out)]
    assert said == [1]  # group a's leader alone
