"""Per-step curves in the engine: the cadence, the window a point reports, the events' shape,
and the training code's opt-in to per-step ``metrics`` (``STEP_METRICS``).

The series of a real ``sync`` run (every step's global loss) are checked in
tests/worker/engine/test_strategies.py; here one short run of a module that opts in.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.engine.conftest import build_spec
from worker.engine import report
from worker.engine.compute import batch_loss
from worker.engine.contract import ContractError, load_training_code
from worker.engine.local import launch_local


def _events(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    lines = capsys.readouterr().out.splitlines()
    return [e for e in map(report.parse_event, lines) if e is not None]


@pytest.mark.parametrize(
    ("setting", "steps_per_epoch", "every"),
    [
        (None, 23, 1),  # fewer than 100 steps an epoch: every step
        (None, 250, 2),
        (None, 10_000, 100),  # about 100 points an epoch
        (None, 1, 1),
        (0, 10_000, 0),  # off
        (7, 10_000, 7),
    ],
)
def test_the_cadence_is_about_100_points_an_epoch_unless_set(
    setting: int | None, steps_per_epoch: int, every: int
) -> None:
    assert report.step_every(setting, steps_per_epoch) == every


def test_a_point_reports_its_window_sample_weighted_in_one_write(
    capsys: pytest.CaptureFixture[str],
) -> None:
    curve = report.StepCurve()
    curve.restart(10, 4)  # an epoch starting at global step 10, a point every 4 steps
    due = []
    for step, (loss, count) in enumerate([(1.0, 2), (4.0, 6)], start=11):
        curve.add(loss * count, count)
        due.append(curve.due(step))
    assert due == [False, True]  # 12 is the first multiple of 4 past 10
    curve.point(step=12, epoch=3, lr=0.05)
    out = capsys.readouterr().out
    assert out.count("\n") == 3  # three lines, one print
    events = [report.parse_event(line) for line in out.splitlines()]
    at = {"step": 12, "epoch": 3, "rank": 0}
    loss, rate, lr = events
    assert loss == {"type": "metric", "name": "step/train_loss", "value": 26 / 8, **at}
    assert rate is not None and rate["name"] == "step/samples_per_s" and rate["value"] > 0
    assert lr == {"type": "metric", "name": "step/lr", "value": 0.05, **at}
    assert (curve.loss_sum, curve.samples, curve.last) == (0.0, 0, 12)  # the next window
    assert not curve.due(15) and curve.due(16)


def test_a_window_without_samples_reports_no_loss_and_a_silent_rank_keeps_in_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    curve = report.StepCurve()
    curve.restart(0, 2)
    curve.add(0.0, 0)  # skipped steps add no samples
    curve.point(step=2, epoch=0, lr=None)
    assert [e["name"] for e in _events(capsys)] == ["step/samples_per_s"]
    curve.add(3.0, 3)
    curve.point(step=4, epoch=0, lr=0.1, send=False)
    assert _events(capsys) == [] and (curve.samples, curve.last) == (0, 4)
    off = report.StepCurve()
    off.restart(0, 0)
    assert not any(off.due(step) for step in range(1, 50))
    assert not off.observe_due(10)


def test_points_of_the_same_second_are_written_together_and_flush_writes_the_rest(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])
    curve = report.StepCurve()
    curve.restart(0, 1)

    def step(n: int, seconds: float) -> list[int]:
        now[0] += seconds
        curve.add(2.0, 2)
        curve.point(step=n, epoch=0, lr=0.1)
        return sorted({e["step"] for e in _events(capsys)})

    assert step(1, 0.01) == [1]  # the first point at once
    assert step(2, 0.3) == [] and step(3, 0.3) == []  # held: under STEP_FLUSH_S since then
    assert step(4, report.STEP_FLUSH_S) == [2, 3, 4]  # with the held ones, in one write
    assert step(5, 0.01) == []
    curve.flush()  # the epoch's end
    assert sorted({e["step"] for e in _events(capsys)}) == [5]
    curve.flush()
    assert _events(capsys) == []


def test_a_point_is_never_held_past_the_next_second_behind_the_users_metrics(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under sync the source worker sends its per-step metrics, then its point, in the same
    step: the metrics' write must not leave the point held until the next point (2 s on,
    here), nor, with points 0.25 s apart, for more than about a second."""
    now = [100.0]
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])
    curve = report.StepCurve()
    curve.restart(0, 1)

    def step(n: int, seconds: float) -> set[tuple[str, int]]:
        now[0] += seconds
        curve.add(1.0, 1)
        curve.send([report.metric_event("step/train_acc", 0.5, step=n, epoch=0, rank=1)])
        now[0] += 0.001
        curve.point(step=n, epoch=0, lr=0.1)
        return {(e["name"], e["step"]) for e in _events(capsys)}

    for n in range(1, 4):  # a point every 2 s: each written in its own step
        assert ("step/train_loss", n) in step(n, 2.0)
    late = {}
    for n in range(4, 20):  # a point every 0.25 s: written within STEP_FLUSH_S + a window
        for _, at in step(n, 0.25):
            late[at] = n
    assert late and all((late[at] - at) * 0.25 <= report.STEP_FLUSH_S + 0.25 for at in late)
    curve.flush()
    assert {e["step"] for e in _events(capsys)} | set(late) == set(range(4, 20))


def test_observation_is_due_once_per_mark() -> None:
    curve = report.StepCurve()
    curve.restart(0, 5)
    assert [s for s in range(1, 16) if curve.observe_due(s)] == [5, 10, 15]
    curve.restart(15, 5)
    assert not curve.observe_due(15) and curve.observe_due(20) and not curve.observe_due(20)


def test_first_lr_reads_the_first_group_without_a_device_sync() -> None:
    params = [torch.nn.Parameter(torch.zeros(1))]
    assert report.first_lr(torch.optim.SGD(params, lr=0.25)) == 0.25
    assert report.first_lr(None) is None


def test_batch_loss_shows_the_output_to_an_observer_after_the_loss() -> None:
    code = load_training_code("example:tiny_regression")
    model = code.build_model()
    inputs, targets = code.build_datasets()[0].tensors  # type: ignore[attr-defined]

    class Source:  # what a worker's data source gives a step: the collated batch
        def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return inputs[indices], targets[indices]

    seen: list[tuple[torch.Size, bool]] = []
    loss = batch_loss(
        code,
        model,
        Source(),  # type: ignore[arg-type]
        torch.arange(5),
        "cpu",
        lambda output, target: seen.append((output.shape, output.requires_grad)),
    )
    assert seen == [(torch.Size([5, 1]), False)]
    loss.backward()  # the observer took nothing from the graph


OPTED_IN = """
from examples.tiny_regression import build_datasets, build_model, build_optimizer, loss_fn

STEP_METRICS = {flag}

def metrics(output, target):
    return {{"abs_error": float((output - target).abs().mean())}}
"""


def _module(tmp_path: Path, flag: str) -> str:
    path = tmp_path / f"opted_{abs(hash(flag))}.py"
    path.write_text(textwrap.dedent(OPTED_IN.format(flag=flag)))
    return str(path)


def test_step_metrics_must_be_a_bool_and_is_off_without_it(tmp_path: Path) -> None:
    assert load_training_code(_module(tmp_path, "True")).step_metrics is True
    assert load_training_code("example:tiny_regression").step_metrics is False
    with pytest.raises(ContractError, match="STEP_METRICS must be True or False"):
        load_training_code(_module(tmp_path, "'yes'"))


def test_an_opted_in_module_reports_its_metrics_per_step_and_worker(tmp_path: Path) -> None:
    """One group of two workers, 23 steps, a point every 5: each worker reports the
    training code's ``metrics`` on its part of the batch at steps 5, 10, 15, 20 (its own
    rank), beside the task's series (rank 0); validation's ``metrics`` run as before."""
    spec = build_spec(
        tmp_path,
        code=_module(tmp_path, "True"),
        epochs=1,
        groups=[{"name": "a", "device_type": "cpu", "workers": 2}],
        step_metrics_every=5,
    )
    run = launch_local(spec, timeout_s=120)
    assert run.ok, {r: run.text(r)[-2000:] for r in run.output}
    points = [e for e in run.events if e.get("name") == "step/train_abs_error"]
    for rank in (1, 2):
        mine = [e for e in points if e["rank"] == rank]
        assert [e["step"] for e in mine] == [5, 10, 15, 20]
        assert all(e["value"] >= 0 and e["epoch"] == 0 for e in mine)
    losses = [e for e in run.events if e.get("name") == "step/train_loss"]
    assert [e["step"] for e in losses] == [5, 10, 15, 20]
    assert {e["rank"] for e in losses} == {0}  # the task's series
    assert run.metrics("val_abs_error")  # the validation metric, per epoch
