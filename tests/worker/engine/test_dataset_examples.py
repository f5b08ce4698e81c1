"""Datasets larger than memory: an image folder read file by file, a memory-mapped array.

``scripts/make_datasets.py`` writes both into a datasets folder (here small);
the examples read them on the streaming path, each worker only the items of
its shard, and learn.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.worker.engine.reference import TIMEOUT_S, finite
from worker.engine.local import LocalRun, launch_local
from worker.engine.spec import RunSpec

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "make_datasets.py"
TWO = [
    {"name": "a", "device_type": "cpu", "workers": 1},
    {"name": "b", "device_type": "cpu", "workers": 1},
]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("datasets")
    made = subprocess.run(
        [sys.executable, str(SCRIPT), str(dest), "--mnist-png", "--limit", "600"]
        + ["--memmap-mb", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    wrote = json.loads(made.stdout)
    assert wrote["mnist_png_files"] == 1200 and wrote["regression_rows"] > 4000
    return dest


def run_example(spec: RunSpec, datasets: Path) -> tuple[LocalRun, str]:
    run = launch_local(spec, timeout_s=TIMEOUT_S, env_extra={"POLYTRAIN_DATASETS": str(datasets)})
    logged = "\n".join(line for lines in run.output.values() for line in lines)
    assert run.ok, logged[-3000:]
    return run, logged


def test_image_folder_streams_and_learns(make_spec: Callable[..., RunSpec], datasets: Path) -> None:
    spec = make_spec(
        code="example:mnist_folder",
        groups=TWO,
        epochs=2,
        global_batch_size=50,
        preprocess=[{"op": "normalize"}],
    )
    run, logged = run_example(spec, datasets)
    assert "600 training and 600 validation items" in logged
    assert "data path: streaming (auto: the datasets are not in-memory TensorDatasets)" in logged
    accuracy = finite(run.metrics("val_accuracy"))
    assert accuracy[-1] > 0.7, accuracy


def test_memory_mapped_array_streams_and_learns(
    make_spec: Callable[..., RunSpec], datasets: Path
) -> None:
    spec = make_spec(code="example:memmap_regression", groups=TWO, epochs=2, global_batch_size=64)
    run, logged = run_example(spec, datasets)
    assert "data path: streaming" in logged
    losses = finite(run.metrics("val_loss"))
    assert losses[-1] < losses[0] * 0.8, losses
