"""bench.time_to_accuracy: the first crossing, the watch that stops a run there, and the
per-arm figures with seeds that never reached the target."""

from bench.time_to_accuracy import (
    Curve,
    Point,
    Watch,
    arm_figures,
    final_accuracy,
    first_crossing,
    seed_order,
    slow_over_fast,
)


def _curve(*accuracies: float, wall: float = 10.0) -> Curve:
    return Curve(
        points=[Point(63 * (i + 1), wall * (i + 1), i + 1.0, a) for i, a in enumerate(accuracies)]
    )


def test_first_crossing_is_the_first_epoch_at_or_above_the_target() -> None:
    points = _curve(0.90, 0.97, 0.95, 0.98).points
    assert first_crossing(points, 0.97) == points[1]  # reaching it exactly counts
    assert first_crossing(points, 0.975) == points[3]  # not the best one, the first
    assert first_crossing(points, 0.99) is None
    assert first_crossing([], 0.5) is None


def test_watch_records_rank_0_validations_and_stops_at_the_crossing() -> None:
    watch = Watch(0.97, started=0.0)

    def metric(name: str, value: float | None, rank: int = 0, step: int = 63) -> bool:
        event = {"type": "metric", "name": name, "value": value, "rank": rank, "step": step}
        return watch(event)

    assert not metric("epoch_time_s", 2.0)
    assert not metric("samples_per_s", 300.0, rank=1)
    assert not metric("samples_per_s", 100.0, rank=2)
    assert not metric("batch_share", 0.25, rank=2)
    assert not metric("val_accuracy", 0.99, rank=1)  # a worker's metric: not the task's
    assert not metric("val_accuracy", None)  # non-finite: nothing to compare
    assert not metric("val_accuracy", 0.95)
    assert not watch({"type": "progress", "step": 63})
    assert not metric("epoch_time_s", 3.0, step=126)
    assert metric("val_accuracy", 0.971, step=126)
    curve = watch.curve
    assert [(p.step, p.train_s, p.accuracy) for p in curve.points] == [
        (63, 2.0, 0.95),
        (126, 5.0, 0.971),
    ]
    assert curve.rates == {1: [300.0], 2: [100.0]} and curve.slow_share == [0.25]
    assert slow_over_fast([curve, Curve()]) == [100.0 / 300.0]


def test_arm_figures_pair_seeds_with_sync_and_leave_out_misses() -> None:
    curves = [_curve(0.9, 0.98, wall=5.0), _curve(0.9, 0.91), _curve(0.98, wall=30.0)]
    sync = [Point(63, 20.0, 4.0, 0.97), Point(63, 20.0, 4.0, 0.97), None]
    figures = arm_figures(curves, 0.97, {"sync": sync}, batch=64)
    assert figures["reached"] == "2/3"
    assert figures["steps"]["values"] == [126, 63]
    assert figures["samples"]["values"] == [126 * 64, 63 * 64]
    assert figures["wall_s"]["values"] == [10.0, 30.0]
    # seed 1 missed, sync missed in seed 2: only seed 0 gives a ratio
    assert figures["wall_over_sync"]["values"] == [0.5]
    assert figures["train_over_sync"]["values"] == [0.5]
    missed = arm_figures([_curve(0.5)], 0.97, {}, batch=64)
    assert missed["reached"] == "0/1" and "wall_s" not in missed
    assert "wall_over_sync" not in missed
    assert figures["train_s"]["values"] == [2.0, 1.0]


def test_seed_order_alternates() -> None:
    assert seed_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert seed_order(["a", "b", "c"], 1) == ["c", "b", "a"]


def test_a_watch_that_does_not_stop_records_every_epoch() -> None:
    watch = Watch(0.97, started=0.0, stop=False)
    event = {"type": "metric", "name": "val_accuracy", "value": 0.99, "rank": 0, "step": 63}
    assert not watch(event)  # past the target, yet the run goes on (--all-epochs)
    assert [p.accuracy for p in watch.curve.points] == [0.99]


def test_final_accuracy_is_compared_with_sync_seed_by_seed_in_points() -> None:
    mine = [_curve(0.90, 0.95), _curve(0.90, 0.97), _curve(0.9)]
    sync = [_curve(0.91, 0.96), _curve(0.92, 0.965), _curve(0.9, 0.9)]
    figures = final_accuracy(mine, sync)
    assert figures["final_accuracy"]["values"] == [0.95, 0.97, 0.9]
    assert figures["final_epochs"] == [2, 2, 1]
    # the third seed ran fewer epochs than sync's: no like-for-like difference
    assert [round(v, 2) for v in figures["final_minus_sync_pp"]["values"]] == [-1.0, 0.5]
    assert "final_minus_sync_pp" not in final_accuracy(mine, None)
