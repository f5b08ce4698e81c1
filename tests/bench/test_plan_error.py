"""bench.plan_error: the pace-based ETA at 25 % progress, and each subset's errors from the
plan's model and the measured runs."""

from __future__ import annotations

import importlib.util

import pytest

from backend.plans.performance import GroupModel, Line, PerformanceModel, Ring, predict
from bench.common import workload
from bench.plan_error import BATCH, EPOCHS, Setup, eta_at, subset_figures, task
from worker.engine.spec import RunSpec


def test_eta_at_25_percent_is_the_pace_since_the_first_report() -> None:
    # First report at t=10 (progress 0.05), then 0.05 per 2 s, all in epoch 0: at 0.25
    # (t=18) the pace is 8 s per 0.20, so 0.75 more take 30 s; the run was done at t=50.
    reports = [(10.0 + 2.0 * i, 0.05 * (i + 1), 0) for i in range(10)]
    eta, actual = eta_at(reports, done_at=50.0)
    assert eta == pytest.approx(30.0)
    assert actual == pytest.approx(32.0)


def test_eta_at_25_percent_spans_the_whole_epoch_once_one_has_ended() -> None:
    # Epoch 0 is progress 0-0.2, its end takes 4 s: epoch 1's first report (0.22) comes at
    # t=22 rather than t=18. The pace to it: 12 s per 0.17; from the report at 0.26 (t=26)
    # the remaining 0.74 take 12 / 0.17 * 0.74 s, not the 16 s per 0.21 of the steps alone.
    reports = [(10.0, 0.05, 0), (16.0, 0.2, 0), (22.0, 0.22, 1), (26.0, 0.26, 1)]
    eta, actual = eta_at(reports, done_at=80.0, epochs=5)
    assert eta == pytest.approx(12 / 0.17 * 0.74)
    assert actual == pytest.approx(54.0)


def test_subset_errors_compare_the_model_with_each_round() -> None:
    groups = [
        GroupModel("a", "cpu", 1, Line(0.002, 0.0002)),
        GroupModel("b", "cpu", 1, Line(0.004, 0.0004)),
        GroupModel("c", "cpu", 1, Line(0.004, 0.0008)),
    ]
    model = PerformanceModel(groups, 4096, 138_000, 3.0, "sync", cross=Ring(1e-4, 1e-9))
    truth = predict(
        model, {"b": 1, "c": 1}, global_batch_size=BATCH, epochs=EPOCHS, split_policy="weighted"
    )
    runs = {
        "plan": [model, model],
        "bc": [
            {
                "epoch_s": truth.epoch_s,
                "eta_s": 10.0,
                "remaining_s": 10.0,
                "wall_s": truth.finish_s,
            },
            {
                "epoch_s": truth.epoch_s / 1.25,
                "eta_s": 9.0,
                "remaining_s": 10.0,
                "wall_s": 2 * truth.finish_s,
            },
        ],
    }
    found = subset_figures(runs, ("b", "c"))
    assert found["epoch_error"]["values"] == [0.0, 0.25]
    assert found["eta_25_error"]["values"] == [0.0, -0.1]
    assert found["finish_error"]["values"] == [0.0, -0.5]


def test_a_setup_sets_the_workloads_samples_and_the_strategy_of_every_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup = Setup(items=1000, strategy="diloco")
    fields = task([{"name": "a", "device_type": "cpu", "workers": 1}], EPOCHS, setup)
    spec = RunSpec.model_validate({"task_id": 0, "checkpoint_dir": "/tmp/x", **fields})
    assert (spec.sync_strategy, spec.sync_period) == ("diloco", 16)
    assert task([], EPOCHS)["sync_strategy"] == "sync"
    for name, value in setup.env.items():
        monkeypatch.setenv(name, value)
    spec_ = importlib.util.spec_from_file_location("hetero_cnn_items", workload("hetero_cnn"))
    assert spec_ is not None and spec_.loader is not None
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    train, val = module.build_datasets()
    assert (len(train), len(val)) == (1000, 512)
