"""bench.rebalance_tracking: reading the rebalances from the parameter server's log and
counting the checks until the slow share settles."""

from __future__ import annotations

import pytest

from bench.rebalance_tracking import (
    BATCH,
    checks_to_settle,
    control_points,
    direction_figures,
    in_run_optimum,
    slow_shares,
)
from worker.engine.local import LocalRun


def test_shares_come_from_the_last_profile_and_every_rebalance_line() -> None:
    log = [
        "profiled samples/s [2025.1, 1235.9] at shares [128, 128]; shares [159, 97]",
        "profiled samples/s [2295.9, 1412.3] at shares [159, 97]; shares [190, 66]",
        "rebalance at step 4: shares [190, 66] -> [180, 76] (predicted imbalance 9.0%)",
        "epoch 0: train_loss 2.301; shares [180, 76]",
        "rebalance at step 36: shares [180, 76] -> [160, 96] (predicted imbalance 23.5% "
        "at the measured samples/s fast 2295.9, slow 1412.3)",  # the line as it is now
    ]
    run = LocalRun(pids={0: 1}, returncodes={0: 0}, output={0: log}, wall_s=1.0)
    assert slow_shares(run) == [(0, 66), (4, 76), (36, 96)]


def test_checks_count_from_the_change_until_the_share_stays_within_five_percent() -> None:
    optimum = 0.4  # 102.4 of 256 samples; within 5 %: 97.3 to 107.5
    assert BATCH == 256 and control_points(16)[:2] == [4, 8]
    moving = [(0, 64), (36, 83), (40, 93), (44, 100)]
    assert checks_to_settle(moving, changed_at=34, optimum=optimum) == 3  # checks 36, 40, 44
    # Within at the first check after the change, out again later: counted from the return.
    back = [(0, 100), (44, 90), (52, 101)]
    assert checks_to_settle(back, changed_at=34, optimum=optimum) == 5  # 36 40 44 48 52
    assert checks_to_settle([(0, 64)], changed_at=34, optimum=optimum) is None


def test_the_optimum_counts_the_fast_groups_speed_beside_a_busy_slow_core() -> None:
    # Alone the fast group runs 3,000 samples/s, beside the busy slow core at 2/3 only
    # 2,700: the split that equalises step times in the run gives the slow group
    # 1,800 / (2,700 + 1,800) = 0.40 of the batch, not 1,800 / 4,800 = 0.375.
    tracked = {
        "epoch_s": [1.0, 1.0, 1.0],
        "shares": [(0, 70), (36, 102)],
        "changed_at": 34,
        "in_run_optimum": 0.35,  # the workers' own rates over the last epoch
    }
    runs = {
        "fast": [3000.0],
        "fast beside low": [2900.0],
        "fast beside high": [2700.0],
        "slow low": [1000.0],
        "slow high": [1800.0],
        "up": [tracked],
        "down": [tracked],
    }
    found = direction_figures(runs, "up")
    assert found["optimal_slow_share"]["median"] == pytest.approx(0.40)
    assert found["optimal_slow_share_standalone"]["median"] == pytest.approx(0.375)
    assert found["checks"] == [1]  # 102 of 256 is within 5 % of 0.40
    assert found["checks_standalone_optimum"] == [None]  # and 6 % above 0.375
    assert found["checks_in_run_optimum"] == [None]  # and 14 % above 0.35
    assert found["in_run_optimal_slow_share"]["median"] == pytest.approx(0.35)


def test_the_in_run_optimum_comes_from_the_workers_last_epoch() -> None:
    def rate(rank: int, value: float) -> dict[str, object]:
        return {"type": "metric", "name": "samples_per_s", "rank": rank, "value": value}

    # epochs 0 and 1 of both workers; the last epoch's rates count
    events = [rate(1, 900.0), rate(2, 100.0), rate(1, 2400.0), rate(2, 800.0)]
    run = LocalRun(pids={0: 1}, returncodes={0: 0}, output={0: []}, wall_s=1.0, events=events)
    assert in_run_optimum(run) == pytest.approx(0.25)  # 800 / (2,400 + 800)
    silent = LocalRun(pids={0: 1}, returncodes={0: 0}, output={0: []}, wall_s=1.0, events=[])
    with pytest.raises(RuntimeError, match="no last-epoch samples/s"):
        in_run_optimum(silent)
