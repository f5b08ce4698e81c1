"""Fixtures for the training-engine tests: run specs for small local worlds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from worker.engine.spec import RunSpec

TWO_GROUPS = [
    {"name": "a", "device_type": "cpu", "workers": 2},
    {"name": "b", "device_type": "cpu", "workers": 1},
]


def build_spec(folder: Path, **overrides: Any) -> RunSpec:
    """A RunSpec checkpointing under `folder`; by default two groups of 2 + 1 workers.

    The guard is off unless a test turns it on: it parks a group from measured step times,
    and with these tiny models one group alone is often the faster, so a test of anything
    else would depend on the host's speed (tests/worker/engine/test_guard.py tests it)."""
    fields: dict[str, Any] = {
        "guard": False,
        "task_id": 1,
        "code": "example:tiny_regression",
        "epochs": 2,
        "global_batch_size": 7,
        "seed": 5,
        "groups": TWO_GROUPS,
        "checkpoint_dir": str(folder / "checkpoints"),
    }
    return RunSpec.model_validate({**fields, **overrides})


@pytest.fixture
def make_spec(tmp_path: Path) -> Callable[..., RunSpec]:
    """Build a RunSpec checkpointing under tmp_path (:func:`build_spec`)."""

    def build(**overrides: Any) -> RunSpec:
        return build_spec(tmp_path, **overrides)

    return build
