"""The load balancer: shares from throughput, an online controller that is damped and bounded."""

from __future__ import annotations

import random

import pytest

from worker.engine.balance import Balancer, by_group, imbalance, rates_of
from worker.engine.compute import Work


def measure(
    shares: list[int],
    speeds: list[float],
    steps: int = 10,
    noise: float = 0.0,
    rng: random.Random | None = None,
) -> tuple[list[float], list[float]]:
    """Compute seconds and samples of a window of ``steps`` steps (time = share / speed)."""
    rng = rng or random.Random(0)
    pairs = zip(shares, speeds, strict=True)
    seconds = [steps * b / s * (1 + rng.uniform(-noise, noise)) for b, s in pairs]
    return seconds, [float(steps * b) for b in shares]


def test_initial_shares_follow_throughput_or_are_even() -> None:
    assert Balancer("weighted", 128).initial([300.0, 100.0]) == [96, 32]
    assert Balancer("even", 128).initial([300.0, 100.0]) == [64, 64]


def test_controller_converges_to_equal_step_times_and_keeps_the_batch() -> None:
    balancer, shares, speeds = Balancer("weighted", 120), [60, 60], [300.0, 100.0]
    history = [shares]
    for _ in range(12):
        proposal = balancer.propose(shares, *measure(shares, speeds))
        shares = proposal or shares
        assert sum(shares) == 120
        history.append(shares)
    assert shares in ([90, 30], [89, 31], [91, 29])
    assert imbalance(shares, speeds) <= balancer.tolerance
    assert [h[0] for h in history] == sorted(h[0] for h in history), "moves are monotone"


def test_noise_inside_the_dead_band_changes_nothing() -> None:
    balancer, shares, rng = Balancer("weighted", 128), [96, 32], random.Random(7)
    for _ in range(200):
        window = measure(shares, [300.0, 100.0], noise=0.02, rng=rng)
        assert balancer.propose(shares, *window) is None


def test_a_slowed_worker_gets_less_without_oscillating() -> None:
    balancer, shares = Balancer("weighted", 64), [32, 32]
    speeds = [100.0, 100.0]
    assert balancer.propose(shares, *measure(shares, speeds)) is None
    speeds = [100.0, 25.0]  # worker 1 slows down four times
    trajectory = []
    for _ in range(15):
        shares = balancer.propose(shares, *measure(shares, speeds)) or shares
        trajectory.append(shares[1])
    assert trajectory[-1] < 32 and trajectory == sorted(trajectory, reverse=True)
    assert len(set(trajectory[-5:])) == 1, "settled"


def test_a_large_change_of_speed_is_followed_in_one_decision() -> None:
    # Worker 1 slows from 100 to 40 samples/s: the split that fits (200 : 80 of 280) was
    # predicted 75 % too slow, far beyond noise, so the controller goes there at once.
    balancer, shares = Balancer("weighted", 280), [140, 140]
    shares = balancer.propose(shares, *measure(shares, [100.0, 40.0])) or shares
    assert shares == [200, 80]
    assert balancer.propose(shares, *measure(shares, [100.0, 40.0])) is None


def test_a_small_excess_is_closed_in_damped_moves() -> None:
    # 5 % over the ideal: half of the way per decision, so noise near the band cannot swing it.
    balancer, shares, speeds = Balancer("weighted", 200), [100, 100], [100.0, 90.0]
    first = balancer.propose(shares, *measure(shares, speeds))
    assert first is not None and 100 < first[0] < 105


def test_even_policy_never_moves() -> None:
    assert Balancer("even", 10).propose([5, 5], [1.0, 100.0], [5.0, 5.0]) is None


def test_rates_of_fills_unmeasured_workers() -> None:
    assert rates_of([2.0, 0.0], [10.0, 0.0]) == [5.0, 5.0]
    assert rates_of([0.0], [0.0]) == [1.0]


def test_once_moving_the_controller_goes_on_to_within_the_settle_band() -> None:
    # 4 % over the ideal triggers a move; a plain dead band would stop just inside 3 %.
    balancer, shares, speeds = Balancer("weighted", 256), [200, 56], [300.0, 100.0]
    assert imbalance(shares, speeds) > balancer.tolerance
    for _ in range(10):
        shares = balancer.propose(shares, *measure(shares, speeds)) or shares
    assert imbalance(shares, speeds) <= balancer.settle
    assert balancer.propose(shares, *measure(shares, speeds)) is None


def window_of(seconds_per_sample: list[float], batch: int = 100) -> Work:
    """A window of sections of ``batch`` samples each taking ``batch * s`` seconds."""
    work = Work()
    for s in seconds_per_sample:
        work.add(batch * s, batch)
    return work


def test_one_disturbed_section_does_not_move_the_window_rate() -> None:
    window = window_of([0.01] * 9 + [0.03])
    assert window.compute_s > 1.1 * window.samples * 0.01
    assert window.robust_seconds == pytest.approx(window.samples * 0.01)


def test_a_recurring_tail_counts_in_the_window_rate() -> None:
    # A worker whose sections run late in 3 of 10 steps takes that much longer per step on
    # average; a median rate would hide it and the controller would leave its share too big.
    window = window_of([0.01] * 7 + [0.013] * 3)
    assert window.robust_seconds == pytest.approx(window.samples * (7 * 0.01 + 2 * 0.013) / 9)
    slowed = Balancer("weighted", 200).propose(
        [100, 100], [window.robust_seconds, 1000 * 0.01], [window.samples, 1000]
    )
    assert slowed is not None and slowed[0] < 100


def test_short_windows_keep_every_section() -> None:
    window = window_of([0.01, 0.01, 0.02])
    assert window.robust_seconds == pytest.approx(window.compute_s)
    assert Work().robust_seconds == 0.0


def test_sections_after_a_wait_do_not_set_the_rate() -> None:
    # A device that runs faster for a while after idling (boost clocks; a CFS-throttled
    # process spending quota it left while it waited) computes sections that follow a wait
    # twice as fast: only the sections it ran without a pause give the rate it keeps when busy.
    work = Work()
    for _ in range(3):
        work.add(1.0, 100, waited=0.0)  # sustained: 100 samples/s
        work.add(0.5, 100, waited=0.3)  # right after a 0.3 s wait: 200 samples/s
    assert work.robust_seconds == pytest.approx(work.samples / 100)
    assert work.compute_s == pytest.approx(4.5)


def test_too_few_sustained_sections_keep_them_all() -> None:
    # A worker that waits before every section (the fast one of a pair) is rated on them all.
    work = Work()
    for seconds in (1.0, 0.5, 0.5):
        work.add(seconds, 100, waited=0.4)
    work.add(1.0, 100, waited=0.0)
    assert work.robust_seconds == pytest.approx(work.compute_s)


def share_trajectory(balancer: Balancer, windows: int, noise: float, seed: int) -> list[int]:
    """The slow worker's share after each of ``windows`` noisy windows (4 steps each) of a
    3 : 1 pair started at its optimum."""
    shares, rng, trajectory = [192, 64], random.Random(seed), []
    for _ in range(windows):
        window = measure(shares, [300.0, 100.0], steps=4, noise=noise, rng=rng)
        shares = balancer.propose(shares, *window) or shares
        trajectory.append(shares[1])
    return trajectory


def test_smoothed_rates_keep_the_shares_nearer_their_optimum_under_noise() -> None:
    # Windows with +-10 % noise on each worker's time: rated window by window, the split
    # follows the noise; averaged over windows it strays less from 64 (the optimum).
    def mean_distance(smoothing: float) -> float:
        runs = [
            share_trajectory(Balancer("weighted", 256, smoothing=smoothing), 100, 0.1, s)
            for s in range(5)
        ]
        return sum(abs(b - 64) for run in runs for b in run) / sum(len(run) for run in runs)

    alone, smoothed = mean_distance(1.0), mean_distance(0.5)
    assert alone > 1.0, "the noise moves an unsmoothed split"
    assert smoothed < 0.75 * alone


def test_a_change_of_speed_after_a_steady_history_is_followed_at_once() -> None:
    balancer, shares = Balancer("weighted", 280), [200, 80]
    for _ in range(10):  # a long history at 100 : 40 samples/s
        assert balancer.propose(shares, *measure(shares, [100.0, 40.0])) is None
    # Worker 1 doubles its speed: its window rate is far from the average, which restarts
    # from this window instead of blending it in, and the split moves the whole way.
    shares = balancer.propose(shares, *measure(shares, [100.0, 80.0])) or shares
    assert shares == [156, 124]
    assert balancer.estimate == pytest.approx([100.0, 80.0])


def test_the_estimate_restarts_only_for_the_worker_whose_speed_changed() -> None:
    balancer = Balancer("weighted", 256)
    balancer.update_estimate([300.0, 100.0])
    # Worker 0's window is noise (+4 %), worker 1's a change (+50 %): worker 0 is blended,
    # worker 1 restarts from its window.
    assert balancer.update_estimate([312.0, 150.0]) == pytest.approx([306.0, 150.0])
    # A worker with no measured step in the window keeps its estimate (its window rate is
    # a stand-in: the others' mean).
    assert balancer.update_estimate([306.0, 306.0], [True, False]) == pytest.approx([306.0, 150.0])


def test_a_window_already_counted_decides_on_the_estimate_without_entering_it() -> None:
    balancer, shares = Balancer("weighted", 256), [192, 64]
    assert balancer.propose(shares, *measure(shares, [300.0, 100.0])) is None
    before = list(balancer.estimate or [])
    # The epoch's whole work, steps before a change of speed included: not blended in.
    epoch = measure(shares, [300.0, 60.0])
    assert balancer.propose(shares, *epoch, update=False) is None
    assert balancer.estimate == before


def test_the_rebalance_log_names_each_groups_measured_rate() -> None:
    """What the parameter server's rebalance line says it acted on: samples/s by group,
    a group of several workers with its workers' rates in brackets."""
    rates = [812.44, 812.36, 501.21]
    assert by_group(rates, [("cpu-a", 2), ("cpu-b", 1)]) == (
        "cpu-a 1624.8 [812.4, 812.4], cpu-b 501.2"
    )
    assert by_group([100.0, 50.0], [("fast", 1), ("slow", 1)]) == "fast 100.0, slow 50.0"
