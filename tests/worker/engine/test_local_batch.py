"""Per-group caps on a worker's samples a step (``GroupPlan.max_local_batch``): the capped
split, the balancer and the guard within the caps, the spec check, and a real run.

A real run's shares are read from the parameter server's log, which names every share the
split takes (the profiled ones, every rebalance and every guard move), and from each
worker's ``batch_share`` metric.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.worker.engine.reference import finite
from tests.worker.engine.test_balance import measure
from tests.worker.engine.test_equivalence import assert_matches_reference
from worker.engine.balance import Balancer, ideal_shares, imbalance
from worker.engine.guard import GroupCost, Guard
from worker.engine.sharding import capped_shares, weighted_shares
from worker.engine.spec import RunSpec
from worker.engine.strategy_diloco import capped_steps

# capped_shares


@pytest.mark.parametrize(
    ("total", "weights", "caps", "expected"),
    [
        (12, [1.0, 1.0, 1.0], [3, 3, None], [3, 3, 6]),
        (12, [4.0, 4.0, 1.0], [4, 4, None], [4, 4, 4]),
        (10, [1.0, 1.0], [5, 5], [5, 5]),  # the caps exactly hold the total
        (100, [3.0, 1.0, 1.0], [40, None, None], [40, 30, 30]),
        (100, [3.0, 1.0, 1.0], [70, None, None], [60, 20, 20]),  # a cap that does not bind
        (9, [5.0, 4.0, 0.0], [2, 2, None], [2, 2, 5]),  # weight 0 takes what is left
        (7, [0.0, 0.0], [3, None], [3, 4]),
    ],
)
def test_capped_shares_hold_the_caps_and_sum_exactly(
    total: int, weights: list[float], caps: list[int | None], expected: list[int]
) -> None:
    assert capped_shares(total, weights, caps) == expected


def test_capped_shares_share_what_is_left_by_weight() -> None:
    # Worker 0 would take 60 of 100: held at 20, the other 80 go 3 : 1 by weight.
    assert capped_shares(100, [6.0, 3.0, 1.0], [20, None, None]) == [20, 60, 20]
    # ... and again when the second is then above its cap (water-filling, repeated).
    assert capped_shares(100, [6.0, 3.0, 1.0], [20, 50, None]) == [20, 50, 30]


def test_capped_shares_without_caps_are_the_weighted_shares() -> None:
    rng = random.Random(36)
    for _ in range(2000):
        n = rng.randint(1, 8)
        total = rng.randint(0, 300)
        weights = [rng.choice([0.0, rng.uniform(0.0, 1000.0), float(rng.randint(1, 9))])]
        weights += [rng.uniform(0.01, 1000.0) for _ in range(n - 1)]
        rng.shuffle(weights)
        minimum = rng.choice([0, 1, 2])
        want = outcome(weighted_shares, total, weights, minimum)
        assert outcome(capped_shares, total, weights, [None] * n, minimum) == want
        if isinstance(want, list):  # caps that do not bind change nothing either
            assert capped_shares(total, weights, [max(want)] * n, minimum) == want


def outcome(function: Callable[..., list[int]], *args: object) -> list[int] | str:
    """What ``function`` returns, or the message of the ValueError it raises."""
    try:
        return function(*args)
    except ValueError as exc:
        return str(exc)


def test_capped_shares_on_random_inputs_sum_exactly_within_the_caps() -> None:
    rng = random.Random(5)
    for _ in range(2000):
        n = rng.randint(1, 8)
        weights = [rng.uniform(0.01, 100.0) for _ in range(n)]
        caps: list[int | None] = [rng.choice([None, rng.randint(1, 40)]) for _ in range(n)]
        room = sum(c for c in caps if c is not None) if None not in caps else 500
        total = rng.randint(n, max(n, room))
        shares = capped_shares(total, weights, caps)
        assert sum(shares) == total
        assert all(c is None or b <= c for b, c in zip(shares, caps, strict=True))
        assert all(b >= 1 for b in shares), (total, weights, caps, shares)


def test_capped_shares_refuse_caps_that_cannot_hold_the_total() -> None:
    with pytest.raises(ValueError, match=r"caps \[3, 4\] hold 7 samples, fewer than the 8"):
        capped_shares(8, [1.0, 1.0], [3, 4])
    with pytest.raises(ValueError, match="2 caps for 3 weights"):
        capped_shares(8, [1.0, 1.0, 1.0], [3, 4])
    with pytest.raises(ValueError, match=">= 0"):
        capped_shares(8, [1.0, 1.0], [-1, None])
    assert capped_shares(8, [1.0, 1.0], [3, None]) == [3, 5]  # one uncapped worker holds it


# The balancer


def test_ideal_shares_hold_a_capped_worker_and_balance_the_rest() -> None:
    shares, step = ideal_shares(120, [300.0, 100.0, 100.0], [30, None, None])
    assert shares == pytest.approx([30.0, 45.0, 45.0])
    assert step == pytest.approx(0.45)
    uncapped, step = ideal_shares(120, [300.0, 100.0], None)
    assert uncapped == pytest.approx([90.0, 30.0]) and step == pytest.approx(0.3)


def test_a_worker_held_at_its_cap_is_no_imbalance() -> None:
    rates = [300.0, 100.0, 100.0]
    assert imbalance([30, 45, 45], rates) > 0.4  # uncapped, worker 0 should take more
    assert imbalance([30, 45, 45], rates, [30, None, None]) == pytest.approx(0.0)
    assert imbalance([20, 50, 50], rates, [30, None, None]) == pytest.approx(0.5 / 0.45 - 1)


def test_initial_shares_respect_the_caps() -> None:
    caps: list[int | None] = [30, 30, None]
    assert Balancer("weighted", 120, caps=caps).initial([300.0, 300.0, 100.0]) == [30, 30, 60]
    assert Balancer("weighted", 120, caps=caps).profiling(3) == [30, 30, 60]
    assert Balancer("weighted", 120).profiling(3) == [40, 40, 40]
    assert Balancer("even", 120, caps=[40, 40, 40]).initial([1.0, 2.0, 3.0]) == [40, 40, 40]
    with pytest.raises(ValueError, match="even split gives worker 0 41 samples"):
        Balancer("even", 121, caps=[40, None, None]).initial([1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="at most 90 samples a step"):
        Balancer("weighted", 120, caps=[30, 30, 30]).initial([1.0, 1.0, 1.0])


def test_the_controller_stops_at_the_capped_target_without_oscillating() -> None:
    # Worker 0 is three times as fast and would take 90 of 120; its memory holds 40.
    balancer = Balancer("weighted", 120, caps=[40, None])
    shares, speeds = balancer.initial([100.0, 100.0]), [300.0, 100.0]
    assert shares == [40, 80]
    for _ in range(30):
        assert balancer.propose(shares, *measure(shares, speeds)) is None
        assert not balancer.moving
    # From a split below the cap it climbs to the cap and stays there.
    balancer, shares, history = Balancer("weighted", 120, caps=[40, None]), [20, 100], []
    for _ in range(30):
        shares = balancer.propose(shares, *measure(shares, speeds)) or shares
        assert shares[0] <= 40 and sum(shares) == 120
        history.append(shares)
    assert history[-1] == [40, 80] and history[-10:] == [[40, 80]] * 10
    assert [h[0] for h in history] == sorted(h[0] for h in history), "moves are monotone"


def test_a_move_with_noise_never_passes_the_cap() -> None:
    balancer, shares = Balancer("weighted", 64, caps=[None, 20, 20]), [24, 20, 20]
    rng = random.Random(3)
    for _ in range(100):
        speeds = [100.0, rng.uniform(50, 400), rng.uniform(50, 400)]
        shares = balancer.propose(shares, *measure(shares, speeds, noise=0.05, rng=rng)) or shares
        assert sum(shares) == 64 and max(shares[1:]) <= 20


def test_park_and_exclude_share_within_the_caps_or_change_nothing() -> None:
    balancer = Balancer("weighted", 12, caps=[4, 4, None, None])
    balancer.estimate = [100.0, 100.0, 100.0, 100.0]
    assert balancer.park({3}, [3, 3, 3, 3]) == [4, 4, 4, 0]
    assert balancer.parked == frozenset({3})
    with pytest.raises(ValueError, match=r"workers \[0, 1\] take at most 8 samples a step"):
        balancer.park({2, 3}, [4, 4, 4, 0])
    assert balancer.parked == frozenset({3})  # unchanged
    with pytest.raises(ValueError, match="at most 8 samples"):
        balancer.exclude({2, 3}, [4, 4, 4, 0])
    assert balancer.excluded == frozenset()
    even = Balancer("even", 12, caps=[4, None, None])
    with pytest.raises(ValueError, match="even split gives worker 0 6 samples"):
        even.exclude({2}, [4, 4, 4])
    assert even.exclude({0}, [4, 4, 4]) == [0, 6, 6]


def test_a_checkpoints_shares_are_fitted_to_the_caps() -> None:
    balancer = Balancer("weighted", 12, caps=[4, 4, None])
    assert balancer.fit([4, 4, 4]) == [4, 4, 4]
    assert balancer.fit([6, 3, 3]) == [4, 4, 4]
    assert balancer.fit([6, 1, 5]) == [4, 1, 7]


# The guard


def test_the_guard_parks_no_group_when_the_others_cannot_hold_the_batch() -> None:
    fast, slow = GroupCost(fixed_s=0.03, rate=690.0), GroupCost(fixed_s=0.12, rate=230.0)
    uncapped = Guard(n_groups=2)
    uncapped.observe({0: fast, 1: slow}, 0.02, active=2)
    assert uncapped.decide(64) == frozenset({1})
    # Group 0 (2 workers of 24) cannot take 64 samples a step alone: group 1 stays.
    capped = Guard(n_groups=2, room=[48, None])
    capped.observe({0: fast, 1: slow}, 0.02, active=2)
    assert capped.decide(64) == frozenset()
    assert capped.decide(48) == frozenset({1})  # 48 it can


# The spec check


def test_a_spec_whose_caps_cannot_hold_the_batch_is_refused(
    make_spec: Callable[..., RunSpec],
) -> None:
    groups = [
        {"name": "a", "device_type": "cpu", "workers": 2, "max_local_batch": 2},
        {"name": "b", "device_type": "cpu", "workers": 1, "max_local_batch": 2},
    ]
    with pytest.raises(ValueError, match="max_local_batch") as refused:
        make_spec(groups=groups, global_batch_size=7)
    message = str(refused.value)
    assert "at most 6 samples a step" in message and "group 'a' 2 × 2" in message
    assert "fewer than global_batch_size 7" in message and "lower global_batch_size" in message
    weighted = {"split_policy": "weighted", "global_batch_size": 7}
    spec = make_spec(groups=[groups[0], {**groups[1], "max_local_batch": 3}], **weighted)
    assert spec.local_batch_caps == [2, 2, 3]
    uncapped = make_spec(groups=[groups[0], {**groups[1], "max_local_batch": None}], **weighted)
    assert uncapped.local_batch_caps == [2, 2, None]
    assert make_spec().local_batch_caps is None


def test_an_even_split_above_a_cap_is_refused(make_spec: Callable[..., RunSpec]) -> None:
    groups = [
        {"name": "a", "device_type": "cpu", "workers": 2},
        {"name": "b", "device_type": "cpu", "workers": 1, "max_local_batch": 2},
    ]
    with pytest.raises(ValueError, match="up to 3 samples a step") as refused:
        make_spec(groups=groups, global_batch_size=7)
    assert "max_local_batch 2 of group 'b'" in str(refused.value)
    assert "split_policy 'weighted'" in str(refused.value)
    assert make_spec(groups=groups, global_batch_size=7, split_policy="weighted")
    assert make_spec(groups=groups, global_batch_size=6)


def test_diloco_local_steps_keep_each_worker_within_its_cap() -> None:
    # A round of 8 split steps in which a worker takes 40 samples: 2 local steps of 20 at
    # most, or as many as a cap of 6 needs (7 steps of at most 6).
    assert capped_steps(2, [(40, None), (40, None)]) == 2
    assert capped_steps(2, [(40, 6), (40, 6)]) == 7
    assert capped_steps(0, [(0, 6)]) == 0


# A real run


def shares_named(log: str) -> list[list[int]]:
    """Every share list the parameter server's log names (profiled, rebalanced, guard)."""
    lists = []
    for line in log.splitlines():
        for found in re.findall(r"shares \[([\d, ]+)\]", line):
            lists.append([int(x) for x in found.split(",")])
        if "->" in line and "rebalance" in line:
            lists.append([int(x) for x in re.findall(r"-> \[([\d, ]+)\]", line)[0].split(",")])
    return lists


def test_a_capped_group_takes_no_more_than_its_cap_and_stays_exact(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    # Group b is at a quarter of the speed: by speed alone each worker of a would take 5 or 6
    # of 12 samples; a's memory holds 4 a worker, so the split holds it there.
    groups = [
        {"name": "a", "device_type": "cpu", "workers": 2, "max_local_batch": 4},
        {"name": "b", "device_type": "cpu", "workers": 1, "speed_factor": 0.25},
    ]
    spec = make_spec(
        split_policy="weighted",
        groups=groups,
        global_batch_size=12,
        rebalance_every=3,
        data={"path": "memory"},
    )
    run, _ = assert_matches_reference(spec, tmp_path / "params")
    named = shares_named(run.text(0))
    assert named, run.text(0)
    for shares in named:
        assert sum(shares) == 12 and max(shares[:2]) <= 4, named
    for rank in (1, 2):
        assert all(share * 12 <= 4 + 1e-9 for share in finite(run.metrics("batch_share", rank)))
