"""The online controller: a worker that slows down mid-run gets a smaller share of the batch."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from tests.worker.engine.reference import dumped_batches, finite, reference_run, run_with_dump
from worker.engine.spec import RunSpec

SLOWS_DOWN = """
import os, time
from examples.tiny_regression import build_datasets, build_model, build_optimizer, loss_fn as mse

calls = 0

def loss_fn(output, target):
    global calls
    calls += 1
    if os.environ.get("RANK") == "2" and calls > 16:  # after the two profiles (12 calls)
        time.sleep(0.015)  # something else starts using this worker's hardware
    return mse(output, target)
"""


def test_slowed_worker_gets_less_and_the_global_batch_stays(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    module = tmp_path / "slows_down.py"
    module.write_text(SLOWS_DOWN)
    spec = make_spec(
        code=str(module),
        split_policy="weighted",
        global_batch_size=24,
        rebalance_every=2,
        epochs=3,
        profile_budget_s=3600,  # every profile step, however slow the host (calls counted)
    )
    run, finals = run_with_dump(spec, tmp_path / "params")
    shares = {rank: finite(run.metrics("batch_share", rank=rank)) for rank in (1, 2, 3)}
    # It ends with less than either other worker, or at the 1-sample floor (on a loaded host
    # another worker can be slowed to the floor too, as a CI run saw), and at most 2 of the
    # 24 samples. (Not "less than it started with": the first profile can already give it
    # the least, 1 sample.)
    last = {rank: found[-1] for rank, found in shares.items()}
    assert last[2] < min(last[1], last[3]) or last[2] == 1 / 24, shares
    assert last[2] <= 2 / 24, shares
    # The parameter server's line says why: the rates it acted on, by group and worker.
    moved = [line for line in run.output[0] if "rebalance at step" in line]
    rate = r"\d+\.\d"
    why = re.compile(
        rf"predicted imbalance {rate}% at the measured samples/s "
        rf"a {rate} \[{rate}, {rate}\], b {rate}\)$"  # conftest.TWO_GROUPS: a (2), b (1)
    )
    assert moved and all(why.search(line) for line in moved), moved
    batches = dumped_batches(tmp_path / "params")
    assert all(len(b) == 24 for i, b in enumerate(batches) if (i + 1) % 7), "B constant"
    # Every rank takes each rebalancing decision itself: the workers must have trained on
    # exactly the global batches the parameter server's split state names, step by step.
    expected, _ = reference_run(spec, batches)
    torch.testing.assert_close(finals[0], expected, atol=1e-5, rtol=0)
    assert all(torch.equal(finals[r], finals[0]) for r in range(spec.world_size))


PROFILED = re.compile(
    r"profiled samples/s \[[^\]]*\] at shares \[([\d, ]+)\]; shares \[([\d, ]+)\]"
)


def profiles(lines: list[str]) -> list[tuple[list[int], list[int]]]:
    """(shares profiled at, shares proposed) of each profiling round the parameter server logged."""
    found = [m for m in map(PROFILED.search, lines) if m]
    return [
        ([int(x) for x in m.group(1).split(",")], [int(x) for x in m.group(2).split(",")])
        for m in found
    ]


def test_weighted_split_profiles_again_at_the_shares_it_will_train_with(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    groups = [
        {"name": "fast", "device_type": "cpu", "workers": 1},
        # 50 times slower: at a quarter (before) one CI run's loaded host slowed the fast
        # worker's few sub-millisecond profile steps past the slow one's padded steps, and the
        # profile at [20, 20] proposed [17, 23]
        {"name": "slow", "device_type": "cpu", "workers": 1, "speed_factor": 0.02},
    ]
    spec = make_spec(groups=groups, split_policy="weighted", global_batch_size=40, epochs=1)
    run, _ = run_with_dump(spec, tmp_path / "params")
    rounds = profiles(run.output[0])
    assert len(rounds) == 2, run.output[0]
    (first_at, first_proposed), (second_at, second_proposed) = rounds
    assert first_at == [20, 20]  # the even share
    assert second_at == first_proposed and first_proposed[1] < 20  # the slow worker got less
    assert sum(second_proposed) == 40
    starts = [finite(run.metrics("batch_share", rank=rank))[0] for rank in (1, 2)]
    assert starts == [share / 40 for share in second_proposed]
    for rank in (1, 2):
        assert len(run.metrics("profiled_samples_per_s", rank=rank)) == 1  # the last profile's
