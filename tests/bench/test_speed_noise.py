"""bench.speed_noise: rates in time bins from steps of any length, and the optimal split's
spread over the bins."""

from __future__ import annotations

import pytest

from bench.speed_noise import binned_rates, share_noise


def test_a_steps_samples_are_spread_over_its_duration() -> None:
    # 10 samples a step: [0, 1) s and [1, 1.5) s; bins of 0.5 s get 5, 5 and 10 samples.
    steps = [(0.0, 1.0), (1.0, 1.5)]
    assert binned_rates(steps, 10, [0.0, 0.5, 1.0, 1.5]) == pytest.approx([10.0, 10.0, 20.0])


def test_a_bin_without_steps_has_no_rate_and_partial_overlaps_count_in_part() -> None:
    assert binned_rates([(0.0, 1.0)], 4, [1.0, 2.0]) == [0.0]
    assert binned_rates([(0.5, 1.5)], 4, [0.0, 1.0]) == pytest.approx([2.0])


def steady(step_s: float, seconds: float) -> list[tuple[float, float]]:
    return [(i * step_s, (i + 1) * step_s) for i in range(int(seconds / step_s))]


def test_steady_loops_have_one_optimal_share_in_every_bin() -> None:
    # 300 and 100 samples/s without a change: the optimum is 0.25 in every bin.
    found = share_noise(steady(0.1, 11.0), steady(0.5, 11.0), (30, 50), width=1.0)
    assert found["bins"] == 10  # from 1 s (after the warm-up) to 11 s (both loops' end)
    assert found["optimal_share"] == pytest.approx(0.25)
    assert found["cv_optimal_share"] == pytest.approx(0.0, abs=1e-9)
    assert found["within_5pct"] == 1.0
    assert found["samples_per_s"] == [pytest.approx(300.0), pytest.approx(100.0)]


def test_a_fast_loop_that_alternates_speed_is_off_the_optimum_in_every_bin() -> None:
    # The fast loop runs at 300 and 150 samples/s in alternate seconds (steps of 0.1 or
    # 0.2 s of 30 samples), the slow one at 100: the optimum swings 0.25 <-> 0.4 around its
    # whole-run value (100 / 325 = 0.31), never within 5 % of it.
    fast, t = [], 0.0
    for second in range(12):
        step = 0.1 if second % 2 == 0 else 0.2
        for _ in range(round(1 / step)):
            fast.append((t, t + step))
            t += step
    found = share_noise(fast, steady(0.5, 12.0), (30, 50), width=1.0)
    assert found["within_5pct"] == 0.0
    assert found["share_range"] == [pytest.approx(0.25), pytest.approx(0.4)]
    assert found["cv_optimal_share"] > 0.2


def test_too_short_a_run_for_two_bins_is_refused() -> None:
    with pytest.raises(ValueError, match="under two bins"):
        share_noise(steady(0.1, 2.0), steady(0.5, 2.0), (30, 50), width=1.0)
