"""Cross-group sync strategies converge, and quorum sync keeps its staleness bound.

tiny_regression over two groups (2 + 1 workers). Periodic averaging and
quorum updates must bring the validation loss down to near the synchronous
result; quorum with a deliberately slow group must update more often than
once per step and never use a gradient more than ``max_staleness`` versions old.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from examples import tiny_regression
from tests.worker.engine.conftest import build_spec
from tests.worker.engine.reference import finite, run_with_dump
from worker.engine.distributed import FIRST_WORKER
from worker.engine.local import LocalRun
from worker.engine.spec import RunSpec
from worker.engine.strategy_sync import PROGRESS_REPORTS_PER_EPOCH

EPOCHS = 4
SLOW_RANK_3 = """
import os, time
from examples.tiny_regression import build_datasets, build_model, build_optimizer, loss_fn as mse

def loss_fn(output, target):
    if os.environ["RANK"] == "3":
        time.sleep(0.01)  # the one-worker group is much slower than the other
    return mse(output, target)
"""


def untrained_val_loss(seed: int) -> float:
    """Validation MSE of the model as built, before any step (2.17 for seed 5)."""
    torch.manual_seed(seed)
    model = tiny_regression.build_model()
    inputs, target = tiny_regression.build_datasets()[1].tensors  # type: ignore[attr-defined]
    with torch.no_grad():
        return float(tiny_regression.loss_fn(model(inputs), target))


SyncRun = tuple[LocalRun, dict[int, torch.Tensor]]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory: pytest.TempPathFactory) -> SyncRun:
    """The synchronous run of EPOCHS epochs (the default spec otherwise), run once: both
    tests that compare with synchronous training compare with this one."""
    folder = tmp_path_factory.mktemp("sync")
    return run_with_dump(build_spec(folder, epochs=EPOCHS), folder / "params")


def final_val_loss(spec: RunSpec, dump: Path, done: SyncRun | None = None) -> float:
    """The last epoch's validation loss, which must be well below the untrained model's
    (`done`: the run of `spec` if it already ran, else it runs now).

    Measured against the untrained model, not the first epoch: quorum updates
    several times per step, so its first epoch already ends near the noise floor
    (0.1-0.16 here) from which later epochs move up and down.
    """
    run, finals = done or run_with_dump(spec, dump)
    assert all(finals[r].equal(finals[0]) for r in finals), "every rank ends on the global model"
    steps = [e["step"] for e in run.events if e.get("name") == "step/train_loss"]
    assert steps and steps == sorted(set(steps)), steps  # the per-step series, in step order
    val = finite(run.metrics("val_loss"))
    assert val[-1] < untrained_val_loss(spec.seed) / 4, val
    return val[-1]


def test_sync_reports_progress_every_few_steps_and_each_epoch_end_once(
    sync_run: SyncRun,
) -> None:
    """The first worker reports every ``steps_per_epoch // 10`` steps (multiples of it) and
    each epoch's end once its end is done; no report follows an epoch's end one step later
    (23 steps an epoch here, every 2: the end at step 46 is a multiple of 2 too)."""
    run, _ = sync_run
    progress = [e for e in run.events if e["type"] == "progress"]
    assert {e["_rank"] for e in progress} == {FIRST_WORKER}
    spe = progress[0]["steps_per_epoch"]
    every, total = max(1, spe // PROGRESS_REPORTS_PER_EPOCH), spe * EPOCHS
    ends = {spe * (epoch + 1) for epoch in range(EPOCHS)}
    expected = sorted(set(range(every, total + 1, every)) | ends)
    assert [e["step"] for e in progress] == expected


def test_sync_reports_the_per_step_series_at_every_step_exactly(sync_run: SyncRun) -> None:
    """23 steps an epoch: the default cadence (about 100 points an epoch) is every step.
    The first worker reports each step's loss, samples/s and lr as the task's (rank 0),
    and the steps' sample-weighted mean (7 samples a step, 6 in the last) is each epoch's
    ``train_loss`` (a per-step point is that step's global loss, not one worker's)."""
    run, _ = sync_run
    points = [e for e in run.events if e["type"] == "metric" and e["name"] == "step/train_loss"]
    assert {e["_rank"] for e in points} == {FIRST_WORKER}
    assert {e["rank"] for e in points} == {0}
    spe = 23
    assert [e["step"] for e in points] == list(range(1, spe * EPOCHS + 1))
    assert [e["epoch"] for e in points] == [s // spe for s in range(spe * EPOCHS)]
    assert run.metrics("step/lr") == [0.02] * (spe * EPOCHS)
    assert all(r is not None and r > 0 for r in run.metrics("step/samples_per_s"))
    for epoch, train_loss in enumerate(finite(run.metrics("train_loss"))):
        losses = [e["value"] for e in points if e["epoch"] == epoch]
        weighted = (7 * sum(losses[:-1]) + 6 * losses[-1]) / 160
        assert weighted == pytest.approx(train_loss, rel=1e-9)


def test_every_rank_reports_where_its_start_up_went(sync_run: SyncRun) -> None:
    """One line per rank names its start-up's parts in order, and ``startup_s`` is their
    sum (the line's figures are rounded to 10 ms)."""
    run, _ = sync_run
    parts = ["import", "rendezvous", "model", "data", "setup", "sync", "profile", "agreement"]
    for rank in run.output:
        (line,) = [line for line in run.output[rank] if f"rank {rank} start-up" in line]
        named = dict(part.rsplit(" ", 1) for part in line.split(" s: ", 1)[1].split(", "))
        assert list(named) == parts, line
        (total,) = run.metrics("startup_s", rank)
        assert total is not None and total > 0
        assert abs(sum(float(s) for s in named.values()) - total) <= 0.01 * len(parts), line


def test_periodic_and_quorum_converge_near_synchronous(
    make_spec: Callable[..., RunSpec], tmp_path: Path, sync_run: SyncRun
) -> None:
    sync = final_val_loss(make_spec(epochs=EPOCHS), tmp_path / "sync", done=sync_run)
    periodic = final_val_loss(
        make_spec(epochs=EPOCHS, sync_strategy="periodic", sync_period=4), tmp_path / "periodic"
    )
    quorum = final_val_loss(
        make_spec(epochs=EPOCHS, sync_strategy="quorum", quorum=1, max_staleness=2),
        tmp_path / "quorum",
    )
    # periodic is deterministic; quorum's updates go ahead in the order they arrive, so how
    # stale each is depends on the host's load (a clean-clone run on a busy host gave 1.50x
    # sync): its bound allows that, and still fails a quorum that does not converge.
    assert periodic <= max(1.5 * sync, sync + 0.05), ("periodic", periodic, sync)
    assert quorum <= max(2.0 * sync, sync + 0.1), ("quorum", quorum, sync)


def test_quorum_with_a_slow_group_updates_more_often_within_the_staleness_bound(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    module = tmp_path / "slow.py"
    module.write_text(SLOW_RANK_3)
    spec = make_spec(code=str(module), sync_strategy="quorum", quorum=1, max_staleness=2)
    run, _ = run_with_dump(spec, tmp_path / "params")
    steps = -(-160 // spec.global_batch_size)
    assert all(u > steps for u in finite(run.metrics("updates"))), run.metrics("updates")
    assert all(0 < s <= 2 for s in finite(run.metrics("max_staleness")))


def test_quorum_of_all_groups_is_synchronous(
    make_spec: Callable[..., RunSpec], tmp_path: Path, sync_run: SyncRun
) -> None:
    _, sync = sync_run
    quorum_of_all = make_spec(epochs=EPOCHS, sync_strategy="quorum", quorum=2)
    run_q, quorum = run_with_dump(quorum_of_all, tmp_path / "q")
    assert (quorum[0] - sync[0]).abs().max() < 1e-5
    assert finite(run_q.metrics("max_staleness")) == [0] * EPOCHS
    # 23 updates per epoch, reported every 2: the epoch's end must still show 100 %.
    progress = [e for e in run_q.events if e["type"] == "progress"]
    last = progress[-1]
    assert last["step"] == last["epochs"] * last["steps_per_epoch"] == 23 * EPOCHS, last
    # Each epoch's end is reported once, after its checkpoint: a pace measured across an
    # epoch's end includes validation and the checkpoint.
    ends = [e["step"] for e in progress if e["step"] % 23 == 0]
    assert ends == [23 * (epoch + 1) for epoch in range(EPOCHS)], ends
    server = [e for e in run_q.events if e["_rank"] == 0 and e["type"] != "log"]
    after = [
        server[i + 1]["type"]
        for i, e in enumerate(server)
        if e["type"] == "checkpoint" and Path(e["path"]).name.startswith("epoch-")
    ]
    assert after == ["progress"] * EPOCHS, after
