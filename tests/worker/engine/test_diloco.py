"""The ``diloco`` strategy: local step counts scaled to the groups' speeds, FedNova-normalised
pseudo-gradients and the outer optimizer (worker/engine/strategy_diloco.py).

Exactness where the algorithm reduces to a known one: with an outer lr of 1, no momentum and
equal step counts (the ``even`` split) it is ``periodic`` model averaging, to float32
rounding. With a group emulated much slower (speed factor, no host timing in the
assertions beyond "much slower"), the ``weighted`` split gives it fewer local steps a round,
and the task still trains.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from tests.worker.engine.reference import finite, run_with_dump
from tests.worker.engine.test_strategies import untrained_val_loss
from worker.engine.sharding import even_shares
from worker.engine.spec import RunSpec
from worker.engine.split import SplitState
from worker.engine.strategy_diloco import chunk_counts, local_steps, round_samples

AVERAGING = {"sync_strategy": "diloco", "outer_lr": 1.0, "outer_momentum": 0.0}


def test_local_steps_take_each_groups_samples_in_global_batches() -> None:
    # group 0: two workers of 30 samples a round; group 1: one worker of 10 (a third as fast)
    assert local_steps([60, 10], 8, batch=10) == [6, 1]
    assert local_steps([60, 10], 8, batch=None) == [8, 8]  # the even split
    # never more than the round's steps, at least one while a group has samples, none without
    assert local_steps([160, 10], 8, batch=10) == [8, 1]
    assert local_steps([60, 1], 8, batch=10) == [6, 1]
    assert local_steps([60, 0], 8, batch=10) == [6, 0]
    assert local_steps([10, 40], 4, batch=12) == [1, 3]


def test_a_round_hands_each_worker_its_split_samples_in_its_groups_local_steps() -> None:
    split = SplitState.initial(100, [6, 6, 2], seed=3)
    split.begin_epoch(3, 0)  # 8 steps of 14, the last one of 2
    assert round_samples(split, 0, 4) == [24, 24, 8]
    last = round_samples(split, 4, split.steps_per_epoch)
    assert sum(last) == 100 - 4 * 14
    # one local step per split step: the split's own counts; fewer: near-equal parts
    assert chunk_counts(split, 0, 0, 4, 4) == [6, 6, 6, 6]
    assert chunk_counts(split, 2, 0, 4, 1) == [8]
    assert chunk_counts(split, 2, 4, 8, 3) == even_shares(last[2], 3)
    assert chunk_counts(split, 2, 4, 8, 0) == []  # a group without samples takes no step


def test_a_group_without_samples_in_a_round_takes_no_step(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    """160 items, B = 53 over three one-worker groups: the epoch's last step has 1 sample
    (160 - 3 * 53) and, as a round of its own (H = 3), gives two groups nothing."""
    solo = [{"name": n, "device_type": "cpu", "workers": 1} for n in ("a", "b", "c")]
    spec = make_spec(groups=solo, global_batch_size=53, sync_period=3, sync_strategy="diloco")
    run, finals = run_with_dump(spec, tmp_path / "params")
    assert all(finals[r].equal(finals[0]) for r in finals)
    assert len(finite(run.metrics("val_loss"))) == spec.epochs


@pytest.mark.parametrize("layout", ["two groups", "one group"])
def test_plain_averaging_equals_periodic_averaging(
    make_spec: Callable[..., RunSpec], tmp_path: Path, layout: str
) -> None:
    """With one group, overlapped too: the outer update it takes a round late is its own model
    of that round's start, so keeping the round's progress on top of it is training alone."""
    groups: dict[str, Any] = {}
    exchanges = ["blocking"]
    if layout == "one group":
        groups = {"groups": [{"name": "solo", "device_type": "cpu", "workers": 2}]}
        exchanges.append("overlapped")
    periodic = make_spec(sync_strategy="periodic", sync_period=4, **groups)
    _, expected = run_with_dump(periodic, tmp_path / "periodic")
    for exchange in exchanges:
        diloco = make_spec(sync_period=4, diloco_exchange=exchange, **AVERAGING, **groups)
        run, found = run_with_dump(diloco, tmp_path / exchange)
        for rank in expected:
            assert torch.allclose(found[rank], expected[rank], rtol=0, atol=1e-6), (exchange, rank)
        assert any("local steps" in line for line in run.output[0])


@pytest.mark.parametrize(
    "outer", [AVERAGING, {"sync_strategy": "diloco"}], ids=["plain", "nesterov"]
)
def test_async_with_every_round_a_barrier_equals_blocking(
    make_spec: Callable[..., RunSpec], tmp_path: Path, outer: dict[str, Any]
) -> None:
    """A checkpoint after every round makes every round a barrier, so the groups stay in step:
    the parts the parameter server applies one by one (in whichever order they arrive) then
    sum to the blocking round's update, and the delayed Nesterov step is the blocking
    Nesterov step, to float rounding."""
    both = {"sync_period": 4, "checkpoint_every": 4, **outer}
    _, expected = run_with_dump(make_spec(**both), tmp_path / "blocking")
    run, found = run_with_dump(make_spec(diloco_exchange="async", **both), tmp_path / "async")
    for rank in expected:
        assert torch.allclose(found[rank], expected[rank], rtol=0, atol=1e-5), rank
    assert not any("stale" in line for line in run.output[0]), run.text(0)


def test_async_lets_a_fast_group_run_ahead_and_scales_its_stale_parts(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    """An even split and a group emulated at a fiftieth of the pace (padded to fifty times its
    own compute, so far slower than the fast group however busy the host): between the
    epoch's barriers the fast group takes several rounds while the slow one takes one, so the
    server applies parts a round or more stale (it logs the stalest), and the model still
    learns."""
    groups = [
        {"name": "fast", "device_type": "cpu", "workers": 1},
        {"name": "slow", "device_type": "cpu", "workers": 1, "speed_factor": 0.02},
    ]
    spec = make_spec(
        groups=groups,
        global_batch_size=16,
        sync_period=2,
        epochs=3,
        rebalance_every=0,
        on_disagreement="off",
        diloco_exchange="async",
        **AVERAGING,
    )
    run, finals = run_with_dump(spec, tmp_path / "params")
    stale = [line for line in run.output[0] if "diloco async: updates up to" in line]
    assert stale and max(int(line.split("up to ")[1].split()[0]) for line in stale) >= 1, run.text(
        0
    )
    assert all(finals[r].equal(finals[0]) for r in finals), "the epoch's end is a barrier"
    val = finite(run.metrics("val_loss"))
    assert val[-1] < untrained_val_loss(spec.seed) / 4, val


@pytest.mark.parametrize("exchange", ["blocking", "overlapped", "async"])
def test_a_much_slower_group_takes_fewer_local_steps_and_the_task_trains(
    make_spec: Callable[..., RunSpec], tmp_path: Path, exchange: str
) -> None:
    """The slow group is emulated at a fiftieth of the pace: the weighted split gives it about a
    hundredth of the round's 5 global batches of 16, so it takes one local step a round and
    the fast group 4-5 (its samples in steps of 16); at a tenth, a loaded host that slowed the
    fast workers' steps eightfold gave the slow group two steps in CI. The global
    model still learns, and with the overlapped and async exchanges every rank still ends on
    the global model (the epoch's end drains)."""
    groups = [
        {"name": "fast", "device_type": "cpu", "workers": 2},
        {"name": "slow", "device_type": "cpu", "workers": 1, "speed_factor": 0.02},
    ]
    spec = make_spec(
        groups=groups,
        split_policy="weighted",
        global_batch_size=16,
        sync_period=5,
        epochs=4,
        diloco_exchange=exchange,
        **AVERAGING,
    )
    run, finals = run_with_dump(spec, tmp_path / "params")
    rounds = [line for line in run.output[0] if "local steps" in line]
    assert rounds, run.text(0)
    for line in rounds:
        fast, slow = (int(part.split()[-1]) for part in line.split("local steps ")[1].split(","))
        assert 4 <= fast <= 5 and slow == 1, line
    assert all(finals[r].equal(finals[0]) for r in finals), "every rank ends on the global model"
    val = finite(run.metrics("val_loss"))
    assert val[-1] < untrained_val_loss(spec.seed) / 4, val


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("outer_momentum", 1.0, "less than 1"),
        ("outer_momentum", -0.5, "greater than or equal to 0"),
        ("outer_lr", 0.0, "greater than 0"),
        ("sync_period", 0, "greater than or equal to 1"),
    ],
)
def test_bad_outer_settings_are_refused_naming_the_field(
    make_spec: Callable[..., RunSpec], field: str, value: float, words: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        make_spec(sync_strategy="diloco", **{field: value})
    error = caught.value.errors()[0]
    assert error["loc"] == (field,) and words in error["msg"]
