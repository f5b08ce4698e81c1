"""What a worker's window counts as its own work: the balancer's input (worker.engine.run.Run,
worker.engine.compute.BusyClock)."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from contracts.plan import warm_point
from worker.engine.balance import Balancer
from worker.engine.compute import BusyClock
from worker.engine.emulation import SpeedEmulator
from worker.engine.run import Run, control_point
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
        topo=SimpleNamespace(worker_index=0, device=torch.device("cpu"), ring_links={}),  # type: ignore[arg-type]
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


def test_the_warm_point_starts_a_window_without_the_first_steps() -> None:
    """At the attempt's warm point (run.warm_at) a new window starts, so the guard and the
    balancer read none of the first steps, whose optimizer step made its state (3 s against
    0.45 s later at 25M parameters on a third of a core); the epoch's work keeps them."""
    run = a_run()
    run.spec.__dict__.update(
        guard=True,
        split_policy="weighted",
        rebalance_every=0,
        checkpoint_every=0,
        on_disagreement="off",
    )
    run.split.epoch_done = False
    run.compute()
    run.step = 1
    control_point(run)  # an ordinary sync point: the window goes on
    run.compute()
    run.step = run.warm_at = 2
    control_point(run)
    run.compute()
    assert run.window.steps == 1 and run.epoch_work.steps == 3


@pytest.mark.parametrize(
    ("step", "split_step", "steps_per_epoch", "period", "expected"),
    [
        (0, 0, 63, 1, 2),  # sync: the second step
        (0, 0, 63, 16, 32),  # diloco: the second round's end
        (45, 20, 63, 16, 73),  # resumed mid-epoch at its step 20: rounds end at 32 and 48
        (0, 0, 10, 16, 10),  # an epoch shorter than a round: its end
        (0, 0, 20, 16, 20),  # the second round cut short by the epoch's end
    ],
)
def test_the_warm_point_is_the_second_sync_point(
    step: int, split_step: int, steps_per_epoch: int, period: int, expected: int
) -> None:
    assert warm_point(step, split_step, steps_per_epoch, period) == expected
