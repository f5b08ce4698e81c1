"""The plan's performance model: fitted from trial timings, its predictions follow the
costs the timings came from (known lines and ring costs here), and its recommendation
leaves out a group whose exchange costs more than its compute saves."""

import math

import pytest

from backend.plans.performance import (
    PerformanceModel,
    Prediction,
    Ring,
    expected_max,
    fit,
    fit_line,
    guarded_groups,
    predict,
    recommend,
    server_need_mb,
)
from backend.plans.service import trial_batch_sizes
from contracts.trial import TrialResult

N_TRAIN = 6400
BYTES = 400_000  # the step's vector
GROUP_RING = Ring(1e-4, 2e-9)
CROSS = Ring(5e-4, 1e-8)


def _trial(
    lines: dict[int, tuple[float, float]],
    workers: dict[int, int],
    *,
    group_ring: Ring = GROUP_RING,
    cross: Ring | None = CROSS,
    trips: dict[int, tuple[float, float]] | None = None,
    sizes: tuple[int, ...] = (8, 16, 32),
    outside: dict[int, tuple[float, float]] | None = None,
    memory: dict[int, dict[str, tuple[float, float]]] | None = None,
) -> TrialResult:
    """A trial whose every timing is exactly the given cost: step ``a + c b`` per group,
    rings for the allreduces, ``l + n m`` round trips; with ``outside``, per group its
    optimizer's set-up seconds and validation seconds per item, 1,000 validation items and
    a 0.2 s checkpoint; with ``memory``, per group lines (intercept, slope) of the measured
    ``peak_mb`` and, where given, ``sharded_peak_mb`` and ``sharded_step_s``."""
    timed = []
    rank = 1
    for g, count in workers.items():
        a, c = lines[g]
        for _ in range(count):
            timed.append(
                {
                    "rank": rank,
                    "group_index": g,
                    "batch_sizes": list(sizes),
                    "step_s": [a + c * b for b in sizes],
                    **(
                        {"setup_s": outside[g][0], "val_s_per_item": outside[g][1]}
                        if outside
                        else {}
                    ),
                    **{
                        key: [a0 + c0 * b for b in sizes]
                        for key, (a0, c0) in ((memory or {}).get(g) or {}).items()
                    },
                }
            )
            rank += 1
    exchanges = []
    two = [1024, BYTES]
    for g, count in workers.items():
        if count > 1:
            exchanges.append(
                {
                    "kind": "group_allreduce",
                    "group_index": g,
                    "members": count,
                    "bytes": two,
                    "seconds": [group_ring.seconds(n, count) for n in two],
                }
            )
    if cross is not None:
        exchanges.append(
            {
                "kind": "leaders_allreduce",
                "members": len(workers),
                "bytes": two,
                "seconds": [cross.seconds(n, len(workers)) for n in two],
            }
        )
    for g, (latency, per_byte) in (trips or {}).items():
        exchanges.append(
            {
                "kind": "ps_round_trip",
                "group_index": g,
                "members": 2,
                "bytes": two,
                "seconds": [latency + per_byte * n for n in two],
            }
        )
    return TrialResult.model_validate(
        {
            "n_train": N_TRAIN,
            "exchange_bytes": BYTES,
            "startup_s": 3.0,
            "workers": timed,
            "exchanges": exchanges,
            **({"n_val": 1000, "checkpoint_s": 0.2} if outside else {}),
        }
    )


GROUPS = [("fast", "cpu", 2), ("slow", "cpu", 1)]


def test_fit_recovers_the_costs_the_timings_came_from() -> None:
    trial = _trial({0: (0.010, 0.002), 1: (0.030, 0.006)}, {0: 2, 1: 1})
    model = fit(trial, GROUPS, sync_strategy="sync")
    fast, slow = model.groups
    assert fast.step.intercept == pytest.approx(0.010) and fast.step.slope == pytest.approx(0.002)
    assert slow.step.intercept == pytest.approx(0.030) and slow.step.slope == pytest.approx(0.006)
    assert fast.ring is not None and slow.ring is None  # one worker: no in-group allreduce
    assert fast.ring.alpha == pytest.approx(1e-4) and fast.ring.beta == pytest.approx(2e-9)
    assert model.cross is not None
    assert model.cross.alpha == pytest.approx(5e-4) and model.cross.beta == pytest.approx(1e-8)
    assert PerformanceModel.from_json(model.to_json()) == model  # stored as JSON and back


def test_the_finish_counts_set_up_profiling_validation_and_checkpoints() -> None:
    """A task's time outside its steps, as the engine spends it: the slowest group's
    optimizer set-up, two profiles under the weighted split (once at the even share, once
    at the chosen shares), the agreement check's step, and each epoch's validation (a block
    in proportion to the batch share, the slowest group's time), the model's transfers and
    a checkpoint, plus the final checkpoint."""
    trial = _trial(
        {0: (0.010, 0.002), 1: (0.030, 0.006)},
        {0: 2, 1: 1},
        trips={0: (0.001, 1e-9), 1: (0.004, 3e-9)},
        outside={0: (0.5, 1e-4), 1: (1.5, 3e-4)},
    )
    model = fit(trial, GROUPS, sync_strategy="periodic", sync_period=4)
    assert PerformanceModel.from_json(model.to_json()) == model
    assert [g.setup_s for g in model.groups] == [0.5, 1.5] and model.checkpoint_s == 0.2
    found = predict(
        model, {"fast": 2, "slow": 1}, split_policy="weighted", global_batch_size=64, epochs=3
    )
    b = 64 / 3
    even_step = max(0.010 + 0.002 * b, 0.030 + 0.006 * b)
    trip = 0.004 + 3e-9 * BYTES  # the slowest group's round trip
    # each profile pass: a warm-up on two samples and 5 timed steps (short: within the
    # budget), the slowest group's
    warm_up = {"fast": 0.010 + 0.002 * 2, "slow": 0.030 + 0.006 * 2}  # on two samples
    second = max(warm_up[g] + 5 * found.compute_s[g] for g in warm_up)
    start = 3.0 + 1.5 + trip + (warm_up["slow"] + 5 * even_step) + second + even_step
    assert found.start_s == pytest.approx(start)
    local = found.local_batch
    val = max(1000 * local["fast"] / 64 * 1e-4, 1000 * local["slow"] / 64 * 3e-4)
    assert found.epoch_end_s == pytest.approx(val + trip + 0.2)
    assert found.finish_s == pytest.approx(start + 3 * (found.epoch_s + val + trip + 0.2) + 0.2)
    # diloco profiles once: a slow group trains at about the fastest group's step size.
    diloco = fit(trial, GROUPS, sync_strategy="diloco", sync_period=16)
    once = predict(
        diloco, {"fast": 2, "slow": 1}, split_policy="weighted", global_batch_size=64, epochs=3
    )
    profile = warm_up["slow"] + 5 * even_step
    assert once.start_s == pytest.approx(3.0 + 1.5 + trip + profile + even_step)


def test_expected_max_is_clarks_and_exact_for_two() -> None:
    """Two standard normals: E[max] = 1/sqrt(pi) exactly; no spread: the plain max; a far
    slower one: its own mean (the other never decides the step)."""
    assert expected_max([0.0, 0.0], [1.0, 1.0]) == pytest.approx(1 / math.sqrt(math.pi))
    assert expected_max([0.2, 0.5, 0.3], [0.0, 0.0, 0.0]) == pytest.approx(0.5)
    assert expected_max([0.010, 1.0], [0.001, 0.01]) == pytest.approx(1.0, abs=1e-9)
    # three groups balanced to the same mean wait longer than two, and than any one
    two, three = expected_max([1.0] * 2, [0.1] * 2), expected_max([1.0] * 3, [0.1] * 3)
    assert 1.0 < two < three
    with pytest.raises(ValueError):
        expected_max([], [])
    with pytest.raises(ValueError):
        expected_max([1.0], [-0.1])


def test_varying_steps_and_a_slow_starter_are_priced() -> None:
    """A group whose steps vary makes every synchronous step wait longer than its mean; a
    subset without the slowest-starting group does not wait for its start-up."""
    trips = {0: (0.001, 1e-9), 1: (0.004, 3e-9)}
    trial = _trial({0: (0.010, 0.002), 1: (0.030, 0.006)}, {0: 2, 1: 1}, trips=trips)
    data = trial.model_dump()
    for worker in data["workers"]:
        slow = worker["group_index"] == 1
        worker["step_sd"] = [0.3 * t if slow else 0.0 for t in worker["step_s"]]
        worker["startup_s"] = 4.0 if slow else 2.0
    data["ps_startup_s"] = 1.5
    model = fit(TrialResult.model_validate(data), GROUPS, sync_strategy="sync")
    assert [g.jitter for g in model.groups] == [0.0, pytest.approx(0.3)]
    steady = fit(trial, GROUPS, sync_strategy="sync")
    kwargs = {"global_batch_size": 64, "epochs": 3, "split_policy": "weighted"}
    both, calm = (
        predict(model, {"fast": 2, "slow": 1}, **kwargs),
        predict(steady, {"fast": 2, "slow": 1}, **kwargs),
    )
    assert both.step_s > calm.step_s
    alone = predict(model, {"fast": 2}, **kwargs)
    # the slowest rank's own start-up: the slow group's 4.0 s with it, the fast group's 2.0
    # without (the parameter server's 1.5 is shorter); untimed, the trial's 3.0
    assert both.start_s - calm.start_s == pytest.approx(4.0 - 3.0)
    assert alone.start_s - predict(steady, {"fast": 2}, **kwargs).start_s == pytest.approx(-1.0)
    # a periodic round's wait is the spread of H = 4 steps' sum: half a step's, relatively
    varying = TrialResult.model_validate(data)
    rounds = fit(varying, GROUPS, sync_strategy="periodic", sync_period=4)
    steady_rounds = fit(trial, GROUPS, sync_strategy="periodic", sync_period=4)
    round_step = predict(rounds, {"fast": 2, "slow": 1}, **kwargs).step_s
    steady_step = predict(steady_rounds, {"fast": 2, "slow": 1}, **kwargs).step_s
    assert steady_step < round_step < steady_step + (both.step_s - calm.step_s)


def test_fit_line_refuses_one_batch_size_and_clamps_noise() -> None:
    with pytest.raises(ValueError, match="distinct"):
        fit_line([(4.0, 1.0), (4.0, 2.0)])
    assert fit_line([(1.0, 2.0), (2.0, 1.0)]).slope == 0.0  # a falling step time is noise


def test_even_and_weighted_predictions_follow_the_costs() -> None:
    trial = _trial({0: (0.010, 0.002), 1: (0.030, 0.006)}, {0: 2, 1: 1})
    model = fit(trial, GROUPS, sync_strategy="sync")
    kwargs = {"global_batch_size": 64, "epochs": 3}
    even = predict(model, {"fast": 2, "slow": 1}, split_policy="even", **kwargs)
    ring = Ring(1e-4, 2e-9).seconds(BYTES, 2)
    cross = Ring(5e-4, 1e-8).seconds(BYTES, 2)
    b = 64 / 3
    assert even.local_batch == {"fast": pytest.approx(b), "slow": pytest.approx(b)}
    assert even.step_s == pytest.approx(max(0.010 + ring + 0.002 * b, 0.030 + 0.006 * b) + cross)
    assert even.epoch_s == pytest.approx(even.step_s * math.ceil(N_TRAIN / 64))
    # Outside the steps: nothing timed but start-up, so the model sent out (the leaders'
    # allreduce priced: no round trip timed), one profile and the agreement check's step.
    even_step = max(0.010 + 0.002 * b, 0.030 + 0.006 * b)
    start = 3.0 + cross + (0.030 + 0.006 * 2) + 5 * even_step + even_step  # warm-up on two
    assert even.start_s == pytest.approx(start)
    assert even.epoch_end_s == pytest.approx(2 * cross)  # fetched from a worker, sent out
    assert even.finish_s == pytest.approx(start + 3 * (even.epoch_s + 2 * cross))
    weighted = predict(model, {"fast": 2, "slow": 1}, split_policy="weighted", **kwargs)
    # Both groups end their compute together, the batch is whole, and it beats even.
    assert weighted.compute_s["fast"] == pytest.approx(weighted.compute_s["slow"], rel=1e-6)
    assert 2 * weighted.local_batch["fast"] + weighted.local_batch["slow"] == pytest.approx(64)
    assert weighted.step_s < even.step_s
    alone = predict(model, {"fast": 2}, split_policy="even", **kwargs)
    assert alone.exchange_s == 0.0  # one group: no cross-group exchange
    assert alone.step_s == pytest.approx(0.010 + ring + 0.002 * 32)


def test_recommendation_leaves_out_a_group_whose_exchange_costs_more_than_it_saves() -> None:
    # A slow group behind a slow link: 40 ms per step of exchange for a few samples' help.
    trial = _trial({0: (0.002, 0.0005), 1: (0.004, 0.004)}, {0: 2, 1: 1}, cross=Ring(0.01, 2e-8))
    model = fit(trial, GROUPS, sync_strategy="sync")
    found = recommend(model, global_batch_size=64, epochs=2)
    assert found.best.workers == {"fast": 2}
    assert set(found.left_out) == {"slow"}
    assert "exchange adds" in found.left_out["slow"] and "compute saves" in found.left_out["slow"]
    assert "the guard parks it" in found.left_out["slow"]
    assert found.marginal_gain_s["slow"] < 0  # adding it would cost time
    alone = recommend(fit(trial, GROUPS[:1], sync_strategy="sync"), global_batch_size=64, epochs=2)
    assert alone.marginal_gain_s == {"fast": None}  # the only group cannot be left out
    assert found.marginal_gain_s["fast"] is None  # the best set's only group
    assert [o.finish_s for o in found.options] == sorted(o.finish_s for o in found.options)
    # Every subset under both policies: {fast}, {slow}, {fast, slow} × even, weighted.
    assert len(found.options) == 6


def test_both_groups_recommended_when_the_exchange_is_cheap() -> None:
    trial = _trial({0: (0.010, 0.002), 1: (0.010, 0.004)}, {0: 2, 1: 1}, cross=Ring(1e-5, 1e-10))
    found = recommend(fit(trial, GROUPS, sync_strategy="sync"), global_batch_size=64, epochs=2)
    assert found.best.workers == {"fast": 2, "slow": 1}
    assert found.best.split_policy == "weighted"
    assert found.left_out == {} and all(g > 0 for g in found.marginal_gain_s.values())


def test_deadline_gives_the_fewest_workers_that_make_it() -> None:
    trial = _trial({0: (0.010, 0.002), 1: (0.010, 0.004)}, {0: 2, 1: 1}, cross=Ring(1e-5, 1e-10))
    model = fit(trial, GROUPS, sync_strategy="sync")
    kwargs = {"global_batch_size": 64, "epochs": 2}
    one = predict(model, {"fast": 1}, split_policy="even", **kwargs)
    found = recommend(model, deadline_s=one.finish_s + 1.0, **kwargs)
    assert found.for_deadline is not None and found.for_deadline.total_workers == 1
    assert found.for_deadline.workers == {"fast": 1}  # the faster of the single workers
    assert found.for_deadline.finish_s <= one.finish_s + 1.0
    too_soon = recommend(model, deadline_s=found.best.finish_s / 2, **kwargs)
    assert too_soon.for_deadline is None


def test_periodic_pays_the_round_trips_once_a_period() -> None:
    trips = {0: (0.001, 1e-8), 1: (0.003, 2e-8)}
    trial = _trial({0: (0.010, 0.002), 1: (0.010, 0.002)}, {0: 2, 1: 1}, cross=None, trips=trips)
    model = fit(trial, GROUPS, sync_strategy="periodic", sync_period=4)
    both = predict(
        model, {"fast": 2, "slow": 1}, split_policy="even", global_batch_size=64, epochs=1
    )
    assert both.exchange_s == pytest.approx((0.003 + BYTES * (1e-8 + 2e-8)) / 4)


def test_diloco_takes_a_slow_groups_samples_without_its_fixed_cost_every_step() -> None:
    # The slow group's fixed cost (0.5 s) outlasts the fast group's whole step: periodic
    # makes it pay that cost every step; diloco lets it take fewer, larger steps.
    trips = {0: (0.001, 1e-9), 1: (0.001, 1e-9)}
    trial = _trial({0: (0.01, 0.001), 1: (0.5, 0.003)}, {0: 2, 1: 1}, cross=None, trips=trips)
    kwargs = {"global_batch_size": 64, "epochs": 1, "split_policy": "weighted"}
    workers = {"fast": 2, "slow": 1}
    periodic_model = fit(trial, GROUPS, sync_strategy="periodic", sync_period=8)
    periodic = predict(periodic_model, workers, guard=False, **kwargs)
    diloco = predict(fit(trial, GROUPS, sync_strategy="diloco", sync_period=8), workers, **kwargs)
    fast_alone = predict(
        fit(trial, GROUPS, sync_strategy="diloco", sync_period=8), {"fast": 2}, **kwargs
    )
    assert periodic.step_s >= 0.5 > diloco.step_s
    # With the guard (the default), periodic parks the slow group: the fast group's step.
    guarded = predict(periodic_model, workers, **kwargs)
    alone = predict(periodic_model, {"fast": 2}, **kwargs)
    assert guarded.parked == ["slow"] and guarded.step_s == pytest.approx(alone.step_s)
    assert diloco.step_s < fast_alone.step_s  # the slow group adds to the fast one
    # the split step's samples, spread by the groups' rates at the fast group's local batch
    fast, slow = diloco.local_batch["fast"], diloco.local_batch["slow"]
    assert 2 * fast + slow == pytest.approx(64) and 0 < slow < fast


def test_diloco_prices_its_rounds_at_the_step_time_measured_at_the_global_batch() -> None:
    # A step's cost per sample grows with the batch (the 34k CNN: 0.36 ms a sample at 86,
    # 0.47 at 256). diloco steps at the global batch, beyond the even share: its trial times
    # that batch and the round is priced at the measured time, not the line's.
    global_batch = 64
    sizes = trial_batch_sizes(global_batch, 3, round_workers=[2, 1])
    assert sizes == [11, 22, 32, 44, 64]  # the even share's three, then 64 / 2 and 64 / 1
    trips = {0: (0.001, 1e-9), 1: (0.001, 1e-9)}
    trial = _trial(
        {0: (0.01, 0.001), 1: (0.01, 0.003)}, {0: 2, 1: 1}, cross=None, trips=trips, sizes=sizes
    )
    convex = trial.model_copy(deep=True)
    for worker in convex.workers:  # each step 1.5 times the line's at 64 samples
        worker.step_s[-1] *= 1.5
    kwargs = {"global_batch_size": global_batch, "epochs": 1, "split_policy": "weighted"}
    workers = {"fast": 2, "slow": 1}
    linear = fit(trial, GROUPS, sync_strategy="diloco", sync_period=8)
    measured = fit(convex, GROUPS, sync_strategy="diloco", sync_period=8)
    assert PerformanceModel.from_json(measured.to_json()) == measured
    fast, slow = measured.groups
    assert fast.step_s(32, 2, BYTES) == pytest.approx(linear.groups[0].step_s(32, 2, BYTES))
    assert slow.step_s(64, 1, BYTES) == pytest.approx(1.5 * (0.01 + 0.003 * 64))
    assert slow.step_s(54, 1, BYTES) == pytest.approx(
        (0.01 + 0.003 * 44) + (1.5 * (0.01 + 0.003 * 64) - (0.01 + 0.003 * 44)) / 2
    )  # between two measured sizes: on the segment, not the line
    rates = [global_batch / fast.step_s(32, 2, BYTES), global_batch / slow.step_s(64, 1, BYTES)]
    trip = (0.001 + BYTES * 2e-9) / 8  # both groups' round trips, once a round of 8 steps
    step = predict(measured, workers, **kwargs).step_s
    assert step == pytest.approx(global_batch / sum(rates) + trip)
    assert step > predict(linear, workers, **kwargs).step_s
    # Beyond the last size, along the line's slope from the last point: never faster.
    assert slow.step_s(80, 1, BYTES) == pytest.approx(
        slow.step_s(64, 1, BYTES) + slow.step.slope * 16
    )
    # The even split's steps (G / W each) are the measured ones too, not a line that the
    # larger diloco sizes have bent.
    even = predict(measured, workers, **{**kwargs, "split_policy": "even"})
    assert even.compute_s["slow"] == pytest.approx(0.01 + 0.003 * global_batch / 3)


def test_a_diloco_round_varies_as_its_groups_own_local_steps_do() -> None:
    # The slow group takes 3 local steps a round of 16: its round's time varies as three
    # steps' sum does (sd / sqrt(3)), not as sixteen's; the round waits for the slower sum.
    trips = {0: (0.001, 1e-9), 1: (0.001, 1e-9)}
    trial = _trial({0: (0.0, 0.001), 1: (0.0, 0.005)}, {0: 1, 1: 1}, cross=None, trips=trips)
    jittery = trial.model_copy(deep=True)
    for worker in jittery.workers:  # every step's standard deviation 30 % of its mean
        worker.step_sd = [0.3 * t for t in worker.step_s]
    groups = [("fast", "cpu", 1), ("slow", "cpu", 1)]
    model = fit(jittery, groups, sync_strategy="diloco", sync_period=16)
    kwargs = {"global_batch_size": 64, "epochs": 1, "split_policy": "weighted"}
    got = predict(model, {"fast": 1, "slow": 1}, **kwargs)
    compute = 64 / (64 / 0.064 + 64 / 0.32)  # both groups' rates at 64 samples a step
    taus = [round(16 * b / 64) for b in (got.local_batch["fast"], got.local_batch["slow"])]
    assert taus == [13, 3]
    spreads = [0.3 * compute / math.sqrt(k) for k in taus]
    trip = (0.001 + BYTES * 2e-9) / 16
    assert got.step_s == pytest.approx(expected_max([compute] * 2, spreads) + trip)
    steady = predict(
        fit(trial, groups, sync_strategy="diloco", sync_period=16), {"fast": 1, "slow": 1}, **kwargs
    )
    assert got.step_s > steady.step_s * 1.05  # the wait for the slower sum: 7.6 % here


def test_a_round_strategy_on_one_group_still_pays_its_round_trip() -> None:
    trips = {0: (0.004, 1e-9), 1: (0.004, 1e-9)}
    trial = _trial({0: (0.01, 0.001), 1: (0.01, 0.003)}, {0: 2, 1: 1}, cross=None, trips=trips)
    kwargs = {"global_batch_size": 64, "epochs": 1, "split_policy": "weighted"}
    for strategy, period in (("periodic", 4), ("diloco", 4)):
        model = fit(trial, GROUPS, sync_strategy=strategy, sync_period=period)
        alone = predict(model, {"fast": 2}, **kwargs)
        assert alone.exchange_s == pytest.approx((0.004 + BYTES * 1e-9) / 4)
    sync = _trial({0: (0.01, 0.001), 1: (0.01, 0.003)}, {0: 2, 1: 1})
    alone = predict(fit(sync, GROUPS, sync_strategy="sync"), {"fast": 2}, **kwargs)
    assert alone.exchange_s == 0.0  # one leader: nothing to allreduce across groups


def test_quorum_epochs_are_set_by_the_slowest_group() -> None:
    # Every group runs every step of a quorum epoch: a group 100 times slower is no help.
    trips = {0: (0.001, 1e-9), 1: (0.001, 1e-9)}
    trial = _trial({0: (0.01, 0.001), 1: (1.0, 0.001)}, {0: 2, 1: 1}, cross=None, trips=trips)
    model = fit(trial, GROUPS, sync_strategy="quorum", quorum=1)
    kwargs = {"global_batch_size": 64, "epochs": 1}
    both = predict(model, {"fast": 2, "slow": 1}, split_policy="weighted", **kwargs)
    assert both.step_s >= 1.0  # the slow group's fixed cost, every step
    found = recommend(model, **kwargs)
    assert found.best.workers == {"fast": 2} and found.marginal_gain_s["slow"] < 0


def test_water_filling_gives_a_group_past_its_fixed_cost_nothing() -> None:
    trial = _trial({0: (0.01, 0.001), 1: (0.5, 0.001)}, {0: 2, 1: 1}, cross=Ring(1e-6, 1e-12))
    model = fit(trial, GROUPS, sync_strategy="sync")
    kwargs = {"split_policy": "weighted", "global_batch_size": 64, "epochs": 1}
    weighted = predict(model, {"fast": 2, "slow": 1}, guard=False, **kwargs)
    # The fast workers take all 64 samples (32 each) and finish long before 0.5 s.
    assert weighted.local_batch["slow"] == 0.0 and weighted.idle == ["slow"]
    assert weighted.local_batch["fast"] == pytest.approx(32.0)
    assert weighted.step_s >= 0.5  # the idle group still pays its fixed cost
    # The guard parks it: the step is the fast group's, after the first check's steps.
    guarded = predict(model, {"fast": 2, "slow": 1}, **kwargs)
    alone = predict(model, {"fast": 2}, **kwargs)
    assert guarded.parked == ["slow"] and guarded.idle == []
    assert guarded.step_s == pytest.approx(alone.step_s) and alone.step_s < 0.5 / 10
    # Start-up and the epoch's end as with both groups; the steps after the first check as
    # the fast group's alone.
    steps = round(weighted.epoch_s / weighted.step_s)
    # The first check comes after the steps that fill 4 s at the profile's slowest step: the
    # slow group's, at the one sample the balancer gives every worker, about its 0.5 s fixed
    # part, so 8 steps, not 10 (contracts.plan.guard_first_check_steps), counted from the end
    # of the second step (the first's one-off costs are judged by no check:
    # contracts.plan.warm_point).
    first = 2 + 8
    saved = (steps - first) * (weighted.step_s - guarded.step_s)
    assert weighted.finish_s - guarded.finish_s == pytest.approx(saved)
    assert guarded.start_s == weighted.start_s and guarded.epoch_end_s == weighted.epoch_end_s


@pytest.mark.parametrize("missing", ["leaders_allreduce", "group_allreduce"])
def test_a_trial_without_an_exchange_the_strategy_needs_cannot_be_fitted(missing: str) -> None:
    trial = _trial({0: (0.01, 0.001), 1: (0.01, 0.001)}, {0: 2, 1: 1})
    kept = [e for e in trial.exchanges if e.kind != missing]
    with pytest.raises(ValueError, match="timed no allreduce"):
        fit(trial.model_copy(update={"exchanges": kept}), GROUPS, sync_strategy="sync")


def test_a_group_the_model_lacks_is_refused() -> None:
    model = fit(
        _trial({0: (0.01, 0.001), 1: (0.01, 0.001)}, {0: 2, 1: 1}), GROUPS, sync_strategy="sync"
    )
    with pytest.raises(KeyError, match="gpu"):
        predict(model, {"gpu": 1}, split_policy="even", global_batch_size=8, epochs=1)


# Memory (issue 36, item 5): 400 MiB whole at no sample plus 2 MiB a sample; sharded over the
# group of 2, 250 MiB plus 2 MiB a sample (it holds half of the 300 MiB of state), its step
# 20 % slower.
MEMORY = {
    "peak_mb": (400.0, 2.0),
    "sharded_peak_mb": (250.0, 2.0),
    "sharded_step_s": (0.012, 0.0024),
}


def _memory_model(limits: dict[str, float], slow_memory: tuple[float, float] = (400.0, 2.0)):
    trial = _trial(
        {0: (0.010, 0.002), 1: (0.030, 0.006)},
        {0: 2, 1: 1},
        memory={0: MEMORY, 1: {"peak_mb": slow_memory}},
    )
    return fit(trial, GROUPS, sync_strategy="sync", group_memory_mb=limits)


def _both_weighted(model: PerformanceModel) -> Prediction:
    """Both groups' prediction, weighted split, 256 a step, the guard off."""
    return predict(
        model,
        {"fast": 2, "slow": 1},
        global_batch_size=256,
        epochs=1,
        split_policy="weighted",
        guard=False,
    )


def test_memory_lines_are_fitted_and_kept() -> None:
    model = _memory_model({"fast": 1000.0, "slow": 1000.0})
    fast, slow = model.groups
    vector = BYTES / 2**20  # a whole worker holds one step's vector more than the trial's step
    assert fast.memory is not None and fast.memory.intercept == pytest.approx(400.0 + vector)
    assert fast.sharded_memory is not None and fast.sharded_memory.slope == pytest.approx(2.0)
    assert fast.sharded_step is not None and fast.sharded_step.slope == pytest.approx(0.0024)
    assert slow.sharded_memory is None and not slow.can_shard(1, "sync")
    assert fast.memory_mb(10, 2, "none") == pytest.approx(420.0 + vector)
    assert fast.memory_mb(10, 2, "fsdp") == pytest.approx(270.0 + vector / 2)  # its rows
    # over 4 workers a worker saves 3/4 of what it shares, not 1/2: 1.5 times the saving at 2
    saved_at_2 = 150.0 + vector / 2
    assert fast.memory_mb(10, 4, "fsdp") == pytest.approx(420.0 + vector - 1.5 * saved_at_2)
    assert fast.memory_per_worker_mb == 1000.0
    assert PerformanceModel.from_json(model.to_json()) == model


def test_a_group_with_less_memory_gets_a_cap_on_its_share() -> None:
    # slow holds 400 + 2 b <= 441: at most 20 samples a step, where its speed alone would not
    # stop the weighted split from giving it more once the fast group's memory is tight too.
    model = _memory_model({"fast": 10_000.0, "slow": 441.0}, slow_memory=(400.0, 2.0))
    guess = _both_weighted(model)
    assert guess.max_local_batch == {"fast": None, "slow": 20}
    assert guess.local_batch["slow"] <= 20 + 1e-9
    assert 2 * guess.local_batch["fast"] + guess.local_batch["slow"] == pytest.approx(256)
    assert guess.sharding == {"fast": "none", "slow": "none"}
    assert guess.memory_mb["slow"] is not None and guess.memory_mb["slow"] <= 441.0
    # the even split would give it 86 samples, more than its memory holds: that set is refused
    with pytest.raises(ValueError, match=r"group 'slow' does not fit its memory: .*572 MiB whole"):
        predict(model, {"fast": 2, "slow": 1}, global_batch_size=256, epochs=1, split_policy="even")


def test_a_model_too_large_whole_is_planned_sharded() -> None:
    # fast holds 500 MiB a worker: whole needs 400 + 2 b, over 500 past 50 samples; sharded
    # 250 + 2 b holds its whole share of a 200 batch (100 a worker), so it shards rather than cap
    model = _memory_model({"fast": 500.0, "slow": 10_000.0})
    guess = predict(model, {"fast": 2}, global_batch_size=200, epochs=1, split_policy="even")
    assert guess.sharding == {"fast": "fsdp"} and guess.max_local_batch == {"fast": None}
    assert guess.memory_mb["fast"] == pytest.approx(450.0 + BYTES / 2**20 / 2)
    assert guess.compute_s["fast"] == pytest.approx(0.012 + 0.0024 * 100)  # the sharded step
    whole = fit(
        _trial({0: (0.010, 0.002)}, {0: 2}, memory={0: MEMORY}, cross=None),
        GROUPS[:1],
        sync_strategy="sync",
    )
    plain = predict(whole, {"fast": 2}, global_batch_size=200, epochs=1, split_policy="even")
    assert plain.sharding == {"fast": "none"}  # no limit known: whole, as before


@pytest.mark.parametrize("strategy", ["periodic", "diloco"])
def test_a_round_strategy_plans_a_model_too_large_whole_sharded(strategy: str) -> None:
    # as above, under the strategies whose rounds exchange a sharded group's own rows
    trial = _trial({0: (0.010, 0.002)}, {0: 2}, memory={0: MEMORY}, cross=None)
    model = fit(
        trial, GROUPS[:1], sync_strategy=strategy, sync_period=4, group_memory_mb={"fast": 500.0}
    )
    assert model.groups[0].can_shard(2, strategy) and not model.groups[0].can_shard(2, "quorum")
    guess = predict(model, {"fast": 2}, global_batch_size=200, epochs=1, split_policy="even")
    assert guess.sharding == {"fast": "fsdp"} and guess.max_local_batch == {"fast": None}


def test_the_guard_never_parks_a_sharded_group_and_under_sync_none_beside_one() -> None:
    # slow's fixed 0.5 s outlasts fast's whole step: the guard parks it, but under sync not
    # where the placement shards fast (its memory holds 600 MiB: 128 samples sharded, fewer
    # whole), for the engine's guard does not act on a sync task with a sharded group.
    trial = _trial(
        {0: (0.010, 0.002), 1: (0.5, 0.006)},
        {0: 2, 1: 1},
        trips={0: (0.001, 1e-9), 1: (0.004, 3e-9)},  # periodic's round trips
        memory={0: MEMORY, 1: {"peak_mb": (400.0, 2.0)}},
    )
    workers = {"fast": 2, "slow": 1}
    kept = {}
    for strategy in ("sync", "periodic"):
        for fast_mb in (10_000.0, 600.0):
            limits = {"fast": fast_mb, "slow": 10_000.0}
            model = fit(
                trial, GROUPS, sync_strategy=strategy, sync_period=4, group_memory_mb=limits
            )
            kept[strategy, fast_mb] = guarded_groups(
                model, workers, global_batch_size=256, split_policy="weighted"
            )
    # Under periodic (and diloco) the guard acts beside a sharded group, which it never parks:
    # the slow group, of 2 workers sharded where its memory holds 600 MiB, stays.
    slow_sharded = _trial(
        {0: (0.010, 0.002), 1: (0.5, 0.006)},
        {0: 2, 1: 2},
        trips={0: (0.001, 1e-9), 1: (0.004, 3e-9)},
        memory={0: {"peak_mb": (400.0, 2.0)}, 1: {**MEMORY, "sharded_step_s": (0.6, 0.007)}},
    )
    groups = [("fast", "cpu", 2), ("slow", "cpu", 2)]
    for slow_mb in (10_000.0, 600.0):
        limits = {"fast": 10_000.0, "slow": slow_mb}
        model = fit(
            slow_sharded, groups, sync_strategy="periodic", sync_period=4, group_memory_mb=limits
        )
        kept["slow", slow_mb] = guarded_groups(
            model, {"fast": 2, "slow": 2}, global_batch_size=256, split_policy="weighted"
        )
    assert kept == {
        ("sync", 10_000.0): ["fast"],
        ("sync", 600.0): ["fast", "slow"],
        ("periodic", 10_000.0): ["fast"],
        ("periodic", 600.0): ["fast"],
        ("slow", 10_000.0): ["fast"],
        ("slow", 600.0): ["fast", "slow"],
    }


def test_a_group_that_holds_no_sample_is_left_out_naming_it_and_the_bytes() -> None:
    # slow (one worker: it cannot shard) needs 402 MiB at one sample and may hold 300
    model = _memory_model({"fast": 10_000.0, "slow": 300.0})
    found = recommend(model, global_batch_size=64, epochs=1, split_policies=["weighted"])
    assert set(found.best.workers) == {"fast"}
    assert found.left_out["slow"] == (
        "group 'slow' does not fit its memory: a worker needs 416 MiB whole at 8 samples a "
        "step, and may hold 300 MiB; raise memory_limit_mb (up to its agents' host memory a "
        "worker), or give it 2 or more workers so it can shard the model"
    )
    assert found.marginal_gain_s["slow"] is None
    alone = fit(
        _trial({0: (0.030, 0.006)}, {0: 1}, memory={0: {"peak_mb": (400.0, 2.0)}}, cross=None),
        [("slow", "cpu", 1)],
        sync_strategy="sync",
        group_memory_mb={"slow": 300.0},
    )
    with pytest.raises(
        ValueError,
        match="no set of the candidate groups fits its memory: group 'slow' does not fit",
    ):
        recommend(alone, global_batch_size=64, epochs=1)


def test_a_capped_group_takes_the_choice_that_holds_more_and_the_task_limit_bounds_cpu() -> None:
    # fast holds 2 + ... : whole 400 + 2 b within 420 holds 10 samples a worker, sharded
    # 250 + 2 b holds 85; with a batch of 256 neither holds its 128, so it is capped sharded
    model = _memory_model({"fast": 420.0, "slow": 10_000.0})
    guess = _both_weighted(model)
    assert guess.sharding["fast"] == "fsdp" and guess.max_local_batch["fast"] == 84
    # the task's memory_limit_mb bounds a CPU group below its agents' memory, not above it
    fast = model.groups[0]
    assert fast.limit_mb(300.0) == 300.0 and fast.limit_mb(8_000.0) == 420.0
    assert fast.limit_mb(None) == 420.0


def test_a_sharded_groups_rounds_add_to_the_parameter_servers_need() -> None:
    # Under periodic a sharded group's rounds go through rank 0 as an owner: 2 round vectors
    # a group and one more (BYTES each) above the trial's 900 MiB; a whole group adds none.
    trial = _trial(
        {0: (0.010, 0.002)},
        {0: 2},
        trips={0: (0.001, 1e-9)},
        memory={0: MEMORY},
        cross=None,
    ).model_copy(update={"ps_peak_mb": 900.0})
    vector = BYTES / 2**20
    for strategy, sharded in (("periodic", 3 * vector), ("sync", 0.0)):
        model = fit(trial, GROUPS[:1], sync_strategy=strategy, sync_period=4)
        assert server_need_mb(model) == 900.0
        assert server_need_mb(model, sharded=1, groups=1) == pytest.approx(900.0 + sharded)
    # A plan whose group must shard (500 MiB a worker) and whose server holds 900 MiB whole
    # and no more fails naming the rounds, under periodic; with room for them it fits.
    limits = {"fast": 500.0}
    for limit, fits in ((900.0 + 3 * vector - 1, False), (900.0 + 3 * vector + 1, True)):
        model = fit(
            trial,
            GROUPS[:1],
            sync_strategy="periodic",
            sync_period=4,
            group_memory_mb=limits,
            memory_limit_mb=limit,
        )
        if fits:
            assert recommend(model, global_batch_size=200, epochs=1).options
        else:
            with pytest.raises(ValueError, match="the rounds of a sharded group's rows"):
                recommend(model, global_batch_size=200, epochs=1)


def test_a_parameter_server_that_does_not_fit_fails_every_set_naming_it() -> None:
    trial = _trial(
        {0: (0.010, 0.002), 1: (0.030, 0.006)}, {0: 2, 1: 1}, memory={0: MEMORY, 1: MEMORY}
    )
    trial = trial.model_copy(update={"ps_peak_mb": 900.0})
    roomy = fit(trial, GROUPS, sync_strategy="sync", memory_limit_mb=1000.0)
    assert recommend(roomy, global_batch_size=64, epochs=1).options  # the server fits
    tight = fit(trial, GROUPS, sync_strategy="sync", memory_limit_mb=800.0)
    with pytest.raises(
        ValueError,
        match="the parameter server does not fit its memory: it "
        "needs 900 MiB .* may hold 800 MiB; raise memory_limit_mb",
    ):
        recommend(tight, global_batch_size=64, epochs=1)
