"""What a worker's window counts as its own work: the balancer's input (worker.engine.run.Run,
worker.engine.compute.BusyClock)."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import Any

import torch

from worker.engine.balance import Balancer
from worker.engine.compute import BusyClock
from worker.engine.emulation import SpeedEmulator
from worker.engine.run import Run
from worker.engine.session import strategy_for

WAIT_S, OWN_S = 0.5, 0.1


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
        spec=SimpleNamespace(  # type: ignore[arg-type]
            sync_strategy="periodic", guard=False, any_sharded=False
        ),
        code=SimpleNamespace(loss_fn=torch.nn.functional.mse_loss, step_metrics=False),  # type: ignore[arg-type]
        topo=SimpleNamespace(worker_index=0, device=torch.device("cpu")),  # type: ignore[arg-type]
        model=torch.nn.Linear(4, 1),
        optimizer=None,
        split=split,  # type: ignore[arg-type]
        balancer=Balancer("weighted", 8),
        train=Items(),
        emulator=SpeedEmulator(),
        strategy=strategy_for("periodic"),
    )


def wait_then_work(clock: BusyClock) -> None:
    """A wait for other ranks, then this worker's own work (its optimizer step, say)."""
    with clock.waiting():
        time.sleep(WAIT_S)
    time.sleep(OWN_S)


def test_own_work_between_two_waits_all_counts_and_the_waits_do_not() -> None:
    run = a_run()
    run.compute()
    wait_then_work(run.clock)  # the group's sum, then the optimizer step
    wait_then_work(run.clock)  # the models' average, then loading it
    run.compute()
    first, second = run.window.sections
    assert second[0] >= 2 * OWN_S, "both stretches of own work are the step's"
    assert second[0] < WAIT_S, "the waits for other ranks are not"
    assert second[2] >= 2 * WAIT_S, "the section is known to follow both waits"
    assert run.window.compute_s == run.epoch_work.compute_s == first[0] + second[0]


def test_the_first_section_of_an_epoch_follows_an_idle_and_the_next_may_be_sustained() -> None:
    run = a_run()
    run.compute()
    with run.clock.waiting():
        pass  # the sum arrived at once
    run.compute()
    first, second = run.window.sections
    assert math.isinf(first[2]), "after the epoch's end: never counted as sustained"
    assert second[2] < 0.1 * second[0] + 1e-3


def test_the_clock_takes_own_work_up_to_now_and_starts_over_after_a_section() -> None:
    clock = BusyClock()
    clock.section_done()
    time.sleep(OWN_S)
    own, waited = clock.take()
    assert own >= OWN_S and waited == 0.0
    clock.section_done()
    own, waited = clock.take()
    assert own < OWN_S and waited == 0.0
