"""An error in the user's code ends every process of the task, with the traceback in its output."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from worker.engine.local import LocalRun, launch_local
from worker.engine.spec import RunSpec

BROKEN_MODEL = """
from examples.tiny_regression import build_datasets, build_optimizer, loss_fn

def build_model():
    raise ValueError("model cannot be built: bad layer size")
"""

BROKEN_LOSS_ON_ONE_WORKER = """
import os
from examples.tiny_regression import build_datasets, build_model, build_optimizer, loss_fn as mse

calls = 0

def loss_fn(output, target):
    global calls
    calls += 1
    if os.environ["RANK"] == "2" and calls == 3:
        raise ValueError("loss exploded on one worker")
    return mse(output, target)
"""

# Peers must notice the failure themselves: the launcher would only kill them much later.
DIST_TIMEOUT_S, FAIL_GRACE_S, TIMEOUT_S = 30, 40.0, 55.0


def run_user_module(tmp_path: Path, make_spec: Callable[..., RunSpec], source: str) -> LocalRun:
    module = tmp_path / "user_code.py"
    module.write_text(source)
    spec = make_spec(code=str(module))
    return launch_local(
        spec,
        env_extra={"POLYTRAIN_DIST_TIMEOUT_S": str(DIST_TIMEOUT_S)},
        timeout_s=TIMEOUT_S,
        fail_grace_s=FAIL_GRACE_S,
    )


def assert_all_gone(run: LocalRun) -> None:
    assert not run.timed_out
    assert all(code == 1 for code in run.returncodes.values()), run.returncodes
    for pid in run.pids.values():
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    assert run.wall_s < DIST_TIMEOUT_S


def test_build_model_error_ends_every_process(
    tmp_path: Path, make_spec: Callable[..., RunSpec]
) -> None:
    run = run_user_module(tmp_path, make_spec, BROKEN_MODEL)
    assert_all_gone(run)
    for rank in run.output:
        text = run.text(rank)
        assert "Traceback (most recent call last)" in text
        assert "ValueError: model cannot be built: bad layer size" in text


def test_error_on_one_worker_mid_training_ends_every_process(
    tmp_path: Path, make_spec: Callable[..., RunSpec]
) -> None:
    run = run_user_module(tmp_path, make_spec, BROKEN_LOSS_ON_ONE_WORKER)
    assert_all_gone(run)
    assert "ValueError: loss exploded on one worker" in run.text(2)
    assert "Traceback (most recent call last)" in run.text(0)
    assert not any(e["type"] == "done" for e in run.events)
