"""A sweep's pure parts: grid and random expansion, the median stopping rule, and the
placement of a trial by a plan's performance model (no database, no clock)."""

import math

import pytest

from backend.plans.performance import Ring, fit
from backend.sweeps import space, stopping
from backend.sweeps.placement import place_trial
from tests.backend.plans.test_performance import GROUPS, _trial


def test_grid_is_every_combination_first_name_slowest_and_capped() -> None:
    grid = {"lr": {"values": [0.1, 0.01]}, "hidden": {"values": [32, 64, 128]}}
    trials = space.expand("grid", grid, None, seed=0)
    assert len(trials) == 6 == space.grid_size(grid)
    assert trials[:4] == [
        {"lr": 0.1, "hidden": 32},
        {"lr": 0.1, "hidden": 64},
        {"lr": 0.1, "hidden": 128},
        {"lr": 0.01, "hidden": 32},
    ]
    assert space.expand("grid", grid, 2, seed=0) == trials[:2]
    with pytest.raises(ValueError, match="grid search needs a list of values"):
        space.grid({"lr": {"min": 0.1, "max": 1.0}})


def test_random_search_is_seeded_on_its_scale_and_within_its_range() -> None:
    ranges = {
        "lr": {"min": 1e-5, "max": 1e-1, "scale": "log", "integer": False},
        "hidden": {"min": 8, "max": 64, "scale": "linear", "integer": True},
        "act": {"values": ["relu", "gelu"]},
    }
    trials = space.expand("random", ranges, 200, seed=7)
    assert trials == space.expand("random", ranges, 200, seed=7)  # the same seed, the same
    assert trials != space.expand("random", ranges, 200, seed=8)
    assert all(1e-5 <= t["lr"] <= 1e-1 for t in trials)
    assert all(isinstance(t["hidden"], int) and 8 <= t["hidden"] <= 64 for t in trials)
    assert {t["act"] for t in trials} == {"relu", "gelu"}
    # log scale: about as many draws in each decade
    decades = [math.floor(math.log10(t["lr"])) for t in trials]
    assert all(25 <= decades.count(d) <= 75 for d in (-5, -4, -3, -2))
    assert len(space.expand("random", ranges, None, seed=0)) == 10  # the default count


def test_median_rule_stops_a_trial_worse_than_the_others_running_averages() -> None:
    others = [{0: 1.0, 1: 0.8}, {0: 0.9, 1: 0.7}, {0: 1.2, 1: 1.0}]  # averages 0.9, 0.8, 1.1
    bad = {0: 1.3, 1: 1.0}  # best 1.0 > median 0.9
    verdict = stopping.should_stop(bad, others, goal="min")
    assert verdict == stopping.Verdict(epoch=1, best=1.0, median=0.9, others=3)
    reason = verdict.reason("val_loss", "min")
    assert "median stopping rule" in reason and "Golovin" in reason
    assert "best val_loss 1 by epoch 1" in reason and "median 0.9 of 3 other trials" in reason
    assert stopping.should_stop({0: 1.3, 1: 0.85}, others, goal="min") is None  # 0.85 < 0.9
    # maximising: the same figures the other way round
    assert stopping.should_stop({0: 0.5, 1: 0.6}, [{0: 0.7, 1: 0.8}] * 3, goal="max")
    assert stopping.should_stop({0: 0.9, 1: 0.6}, [{0: 0.7, 1: 0.8}] * 3, goal="max") is None


def test_median_rule_waits_for_enough_epochs_and_trials() -> None:
    others = [{0: 0.5, 1: 0.4}] * 3
    assert stopping.should_stop({0: 9.0}, others, goal="min") is None  # one epoch < 2
    assert stopping.should_stop({0: 9.0}, others, goal="min", min_epochs=1) is not None
    assert stopping.should_stop({0: 9.0, 1: 9.0}, others[:2], goal="min") is None  # 2 < 3
    # only trials that reached the epoch count: one stopped at epoch 0 does not
    assert stopping.should_stop({0: 9.0, 1: 9.0}, [*others[:2], {0: 0.1}], goal="min") is None
    assert stopping.objective({0: 0.5, 1: 0.3, 2: 0.4}, "min") == 0.3
    assert stopping.objective({0: 0.5, 1: 0.3}, "max") == 0.5
    assert stopping.objective({}, "min") is None


def test_a_trial_goes_where_it_finishes_soonest_while_the_others_are_busy() -> None:
    # Cheap exchange: both groups together are fastest when both are free.
    trial = _trial({0: (0.010, 0.002), 1: (0.010, 0.004)}, {0: 2, 1: 1}, cross=Ring(1e-5, 1e-10))
    model = fit(trial, GROUPS, sync_strategy="sync")
    kwargs = {"global_batch_size": 64, "epochs": 2, "split_policy": "weighted"}
    free = place_trial(model, {}, **kwargs)
    assert free.prediction.workers == {"fast": 2, "slow": 1} and free.start_s == 0.0
    # "fast" busy for long with another trial: "slow" alone finishes sooner than waiting.
    busy_fast = place_trial(model, {"fast": 1000.0}, **kwargs)
    assert busy_fast.prediction.workers == {"slow": 1} and busy_fast.start_s == 0.0
    # "slow" busy: "fast" alone.
    assert place_trial(model, {"slow": 1000.0}, **kwargs).prediction.workers == {"fast": 2}
    # Both busy, "fast" free sooner: wait for it rather than for "slow".
    both = place_trial(model, {"fast": 5.0, "slow": 1000.0}, **kwargs)
    assert both.prediction.workers == {"fast": 2} and both.start_s == 5.0
    assert both.finish_s == pytest.approx(5.0 + both.prediction.finish_s)
    # Busy only a moment: still worth waiting for the fastest set.
    tiny = place_trial(model, {"fast": 0.001}, **kwargs)
    assert tiny.prediction.workers == {"fast": 2, "slow": 1}


def test_groups_are_busy_until_their_trials_predicted_end() -> None:
    """A started trial holds its groups until its predicted end, one still queued from when
    its groups free up, one without a prediction for ever; ended trials hold nothing."""
    from datetime import datetime, timedelta

    from backend.sweeps.service import _busy_s
    from backend.tasks.models import Task, TaskStatus

    now = datetime(2026, 1, 1, 12, 0, 0)

    def trial(groups: list[str], status: TaskStatus, predicted: float | None, started_s=None):  # type: ignore[no-untyped-def]
        spec = {
            "epochs": 1,
            "global_batch_size": 8,
            "groups": [{"name": g, "device_type": "cpu", "workers": 1} for g in groups],
            **({"predicted_s": predicted} if predicted is not None else {}),
        }
        started = None if started_s is None else now - timedelta(seconds=started_s)
        return Task(spec=spec, status=status, started_at=started)

    busy = _busy_s(
        None,  # type: ignore[arg-type]
        [
            trial(["a"], TaskStatus.RUNNING, 100.0, started_s=30),  # 70 s left
            trial(["a", "b"], TaskStatus.QUEUED, 50.0),  # after "a": 70 + 50
            trial(["c"], TaskStatus.SUCCEEDED, 10.0, started_s=1),
        ],
        now,
    )
    assert busy == {"a": 120.0, "b": 120.0}
    assert _busy_s(None, [trial(["d"], TaskStatus.RUNNING, None, 5)], now) == {"d": math.inf}  # type: ignore[arg-type]
