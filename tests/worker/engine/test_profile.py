"""The throughput profile at a task's start stops early on a slow worker
(``profile_budget_s``), and never in a sharded group, whose members step together."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from contracts.trial import profile_timed_steps
from worker.engine.local import launch_local
from worker.engine.spec import RunSpec

pytestmark = pytest.mark.timeout(240)

# Each call of loss_fn (a profile step, the agreement check, a training or validation step)
# leaves a line in a file of its rank.
COUNTED = """
import os
import torch
from torch import nn
from torch.utils.data import TensorDataset

def build_model():
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

def build_datasets():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = x.sum(1, keepdim=True)
    return TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:])

def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.05)

def loss_fn(output, target):
    with open(os.path.join(CALLS, os.environ["RANK"]), "a") as calls:
        calls.write("call\\n")
    return nn.functional.mse_loss(output, target)
"""


@pytest.mark.parametrize(
    ("step_s", "budget_s", "expected"),
    [
        (0.01, 2.0, 5),  # short steps: all of them
        (0.5, 2.0, 4),  # 4 x 0.5 s reaches the budget
        (0.7, 2.0, 3),
        (4.0, 2.0, 1),  # one long step is the rate
        (4.0, None, 5),  # no budget
    ],
)
def test_a_profile_takes_its_steps_until_their_seconds_reach_the_budget(
    step_s: float, budget_s: float | None, expected: int
) -> None:
    assert profile_timed_steps(step_s, 5, budget_s) == expected


def test_a_whole_worker_stops_at_the_budget_and_a_sharded_group_takes_every_step(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    calls: dict[float, dict[int, int]] = {}
    for budget in (1e-9, 3600.0):  # stop after one timed step; take all of them
        folder = tmp_path / f"budget-{budget}"
        (folder / "calls").mkdir(parents=True)
        module = folder / "counted.py"
        module.write_text(f"CALLS = {str(folder / 'calls')!r}\n" + COUNTED)
        spec = make_spec(
            code=str(module),
            epochs=1,
            global_batch_size=12,
            split_policy="even",
            profile_steps=4,
            profile_budget_s=budget,
            checkpoint_dir=str(folder / "checkpoints"),
            groups=[
                {"name": "a", "device_type": "cpu", "workers": 2, "sharding": "fsdp"},
                {"name": "b", "device_type": "cpu", "workers": 1},
            ],
        )
        run = launch_local(spec, timeout_s=200)
        assert run.ok, run.text(3)[-3000:]
        calls[budget] = {
            int(f.name): len(f.read_text().splitlines()) for f in (folder / "calls").iterdir()
        }
    short, full = calls[1e-9], calls[3600.0]
    assert sorted(full) == sorted(short) == [0, 1, 2, 3]  # the server: the agreement check
    # the whole worker's profile: 1 timed step instead of 4; everything else alike
    assert full[3] - short[3] == 3, calls
    assert full[0] == short[0], calls
    # the sharded group's members gather every unit together: every step, whatever the budget
    assert full[1] == short[1] and full[2] == short[2], calls
