"""The online controller: a worker that slows down mid-run gets a smaller share of the batch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.worker.reference import dumped_batches, finite, run_with_dump
from worker.engine.spec import RunSpec

SLOWS_DOWN = """
import os, time
from examples.tiny_regression import build_datasets, build_model, build_optimizer, loss_fn as mse

calls = 0

def loss_fn(output, target):
    global calls
    calls += 1
    if os.environ["RANK"] == "2" and calls > 6:
        time.sleep(0.004)  # something else starts using this worker's hardware
    return mse(output, target)
"""


def test_slowed_worker_gets_less_and_the_global_batch_stays(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    module = tmp_path / "slows_down.py"
    module.write_text(SLOWS_DOWN)
    spec = make_spec(
        code=str(module), split_policy="weighted", global_batch_size=24, rebalance_every=2, epochs=3
    )
    run, _ = run_with_dump(spec, tmp_path / "params")
    shares = finite(run.metrics("batch_share", rank=2))
    assert shares[-1] < shares[0] and shares[-1] <= 2 / 24, shares
    assert any("rebalance at step" in line for line in run.output[0])
    batches = dumped_batches(tmp_path / "params")
    assert all(len(b) == 24 for i, b in enumerate(batches) if (i + 1) % 7), "B constant"
