"""bench.hetero_bound: the most a throttled group can add, from its measured fixed and
per-sample costs."""

from __future__ import annotations

import pytest

from bench.hetero_bound import best_gain, bounds


def test_a_slow_group_with_no_fixed_cost_reaches_the_ideal() -> None:
    # Fast: 100 ms for 100 samples; slow: 3 ms a sample and nothing else. The best split
    # equalises 100 (100 - b) / 100 = 3 b: b = 25, a step of 75 ms, gain 100 / 75.
    assert best_gain(0.100, 100, lambda b: 0.003 * b) == pytest.approx(100 / 75)


def test_a_fixed_cost_above_the_fast_step_leaves_the_fast_group_alone() -> None:
    # The slow group's step costs 150 ms whatever its share: no split beats the fast group
    # alone, whose gain is 1.
    assert best_gain(0.100, 100, lambda b: 0.150 + 0.003 * b) == 1.0


def test_ceilings_divide_by_the_ideal_of_the_same_round() -> None:
    # B = 101: fast 100 ms a step, slow 400 ms (ideal 1.25), slow floor (1 sample) 4 ms,
    # so 3.96 ms a further sample; a synchronous step with it costs at least 200 ms: sync
    # cannot gain (1 / 1.25). Periodic pays the floor and an 8th of a 16 ms exchange a
    # step: at b = 19 the fast step is 100 * 82 / 101 = 81.19 ms and the slow one
    # 4 + 18 * 3.96 + 2 = 77.3 ms; at b = 20 the slow one is 81.24: the best is 81.19 ms,
    # gain 100 / 81.19 = 1.2317, over the ideal 0.985.
    runs = {
        "fast_alone": [0.100],
        "slow_alone": [0.400],
        "slow_floor": [0.004],
        "sync_floor": [0.200],
        "exchange": [0.016],
    }
    found = bounds(runs, 101)
    assert found["ideal"] == [pytest.approx(1.25)]
    assert found["sync"] == [pytest.approx(1 / 1.25)]
    assert found["periodic"] == [pytest.approx(0.9853, abs=1e-4)]
