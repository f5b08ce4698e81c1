"""What a worker's window counts as its own work: the balancer's input (worker.engine.run.Run)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch

from worker.engine.balance import Balancer
from worker.engine.emulation import SpeedEmulator
from worker.engine.run import Run

WAIT_S, OWN_S = 1.0, 0.2


class Items:
    """Eight items of 4 features and a scalar target, read in any order."""

    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def __len__(self) -> int:
        return 8

    def take(self, indices: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[indices], self.y[indices]

    def expects(self, indices: Any) -> bool:
        return True

    def plan(self, batches: Any) -> None:
        pass


def a_run() -> Run:
    split = SimpleNamespace(take=lambda worker: torch.arange(8), upcoming=lambda worker: [])
    return Run(
        spec=SimpleNamespace(sync_strategy="periodic"),  # type: ignore[arg-type]
        code=SimpleNamespace(loss_fn=torch.nn.functional.mse_loss),  # type: ignore[arg-type]
        topo=SimpleNamespace(worker_index=0, device=torch.device("cpu")),  # type: ignore[arg-type]
        model=torch.nn.Linear(4, 1),
        optimizer=None,
        split=split,  # type: ignore[arg-type]
        balancer=Balancer("weighted", 8),
        train=Items(),
        emulator=SpeedEmulator(),
    )


def test_work_since_the_last_wait_counts_and_the_wait_does_not() -> None:
    run = a_run()
    run.compute()
    time.sleep(WAIT_S)  # blocked on other ranks (a sum, a control point)
    run.ready()
    time.sleep(OWN_S)  # this worker's own work between steps (its optimizer step, say)
    run.compute()
    first, second = run.window.sections
    assert second[0] >= OWN_S, "the work after the wait is the step's"
    assert second[0] < WAIT_S, "the wait for other ranks is not"
    assert second[2] >= WAIT_S, "the section is known to follow a wait"
    assert first[2] == 0.0
    assert run.window.compute_s == run.epoch_work.compute_s == first[0] + second[0]


def test_a_section_without_a_wait_before_it_is_sustained() -> None:
    run = a_run()
    run.compute()
    run.ready()  # the sum arrived at once
    run.compute()
    assert run.window.sections[1][2] < 0.05
