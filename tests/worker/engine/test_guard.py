"""The guard (worker/engine/guard.py): its cost model and decisions, and a sync task that
parks a group and takes it back while staying the single-process step on every global batch.

The decisions are pure functions of measured costs, tested on given numbers. The engine's
side runs real gloo processes: a schedule (``debug_guard_schedule``) parks a group and takes
it back at known steps, and the result must equal one process on the same global batches
to 1e-5, every rank on the same bits; a group whose optimizer step really computes for
much longer than the other group's whole step (a large matrix product, not a sleep) is
parked by the guard's own prediction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from contracts.plan import GUARD_CHECK_STEPS, guard_first_check_steps
from tests.worker.engine.reference import (
    assert_every_sample_once,
    dumped_batches,
    reference_run,
    run_with_dump,
)
from tests.worker.engine.test_equivalence import assert_matches_reference
from worker.engine.guard import GroupCost, Guard, round_step_seconds, step_seconds
from worker.engine.run import guard_check, guard_due, guarding, window_start
from worker.engine.session import strategy_for
from worker.engine.spec import RunSpec

B = 64


def test_balanced_step_of_equal_groups_is_the_batch_over_their_rates() -> None:
    cost = GroupCost(fixed_s=0.0, rate=100.0)
    assert step_seconds([cost, cost], B) == pytest.approx(B / 200.0)


def test_balanced_step_adds_the_fixed_parts_by_rate() -> None:
    # (B + sum r_g a_g) / sum r_g: both groups finish together.
    fast, slow = GroupCost(0.01, 300.0), GroupCost(0.02, 100.0)
    seconds = (B + 300 * 0.01 + 100 * 0.02) / 400
    assert step_seconds([fast, slow], B) == pytest.approx(seconds)
    # check: each group's share over its rate plus its fixed part is that same time
    share_fast = 300 * (seconds - 0.01)
    share_slow = 100 * (seconds - 0.02)
    assert share_fast + share_slow == pytest.approx(B)


def test_a_group_whose_fixed_part_outlasts_the_step_takes_no_samples_but_costs_it() -> None:
    fast, slow = GroupCost(0.01, 1000.0), GroupCost(0.5, 1000.0)
    assert step_seconds([fast, slow], B) == pytest.approx(0.5)
    assert step_seconds([fast], B) == pytest.approx(0.01 + B / 1000.0)


def test_step_seconds_needs_a_group_with_a_rate() -> None:
    with pytest.raises(ValueError, match="at least one group"):
        step_seconds([], B)
    with pytest.raises(ValueError, match="no group has a measured rate"):
        step_seconds([GroupCost(0.1, 0.0)], B)


def guard_with(costs: dict[int, GroupCost], overhead_s: float = 0.0) -> Guard:
    guard = Guard(n_groups=len(costs))
    guard.observe(costs, overhead_s, active=len(costs))
    return guard


def test_a_group_that_stays_is_never_parked() -> None:
    # the 10M case below: the slow group is parked, unless it stays (Guard.stays: sharded)
    fast, slow = GroupCost(fixed_s=0.03, rate=690.0), GroupCost(fixed_s=0.12, rate=230.0)
    decided = {}
    for stays in (frozenset({0}), frozenset({1})):
        guard = Guard(n_groups=2, stays=stays)
        guard.observe({0: fast, 1: slow}, 0.02, active=2)
        decided[stays] = guard.decide(B)
    assert decided == {frozenset({0}): frozenset({1}), frozenset({1}): frozenset()}


def test_identical_groups_stay_on_the_step_path() -> None:
    guard = guard_with({0: GroupCost(0.005, 500.0), 1: GroupCost(0.005, 500.0)}, 0.01)
    assert guard.decide(B) == frozenset()


def test_a_group_whose_update_outlasts_the_fast_groups_step_is_parked() -> None:
    # The 10M case of docs/benchmarks.md: the slow group's step with one sample (its update
    # over every parameter) outlasts the fast group's whole step.
    fast, slow = GroupCost(fixed_s=0.03, rate=690.0), GroupCost(fixed_s=0.12, rate=230.0)
    guard = guard_with({0: fast, 1: slow}, overhead_s=0.02)
    assert guard.decide(B) == frozenset({1})


def test_the_slowest_group_is_the_one_parked_and_the_last_group_never_is() -> None:
    costs = {0: GroupCost(0.3, 50.0), 1: GroupCost(0.001, 1000.0), 2: GroupCost(0.002, 900.0)}
    guard = guard_with(costs)
    assert guard.decide(B) == frozenset({0})
    alone = Guard(n_groups=2, parked=frozenset({1}))
    alone.observe({0: GroupCost(5.0, 1.0)}, 0.0, active=1)
    alone.costs[1] = GroupCost(100.0, 1.0)  # worse still: no move helps
    assert alone.decide(B) == frozenset({1})  # group 0 is the only one stepping: it stays


def test_a_parked_group_comes_back_when_the_active_one_slows_down() -> None:
    guard = guard_with({0: GroupCost(0.01, 2000.0), 1: GroupCost(0.05, 400.0)}, 0.01)
    guard.parked = guard.decide(B)
    assert guard.parked == frozenset({1})
    guard.observe({0: GroupCost(0.01, 2000.0)}, 0.002, active=1)
    assert guard.decide(B) == frozenset({1})  # unchanged costs: it stays parked
    guard.observe({0: GroupCost(0.01, 150.0)}, 0.002, active=1)  # the fast group slowed
    assert guard.decide(B) == frozenset()


def test_a_gain_inside_the_margin_moves_nothing() -> None:
    # Parking group 1 would save about 5 % of the step: under the 10 % margin.
    fast, slow = GroupCost(0.0, 1000.0), GroupCost(0.0, 50.0)
    guard = guard_with({0: fast, 1: slow}, overhead_s=0.0)
    alone = guard.predicted_s([0], B)
    both = guard.predicted_s([0, 1], B)
    assert both < alone  # the slow group adds a little
    guard.overhead_many_s = alone * 1.05 - both  # the exchange takes it back, and 5 % more
    guard.overhead_one_s = 0.0
    assert guard.decide(B) == frozenset()
    guard.overhead_many_s = alone * 1.2 - both
    assert guard.decide(B) == frozenset({1})


def test_groups_left_out_for_good_are_never_taken_back() -> None:
    guard = guard_with({0: GroupCost(0.01, 100.0), 1: GroupCost(0.001, 1000.0)})
    guard.parked = frozenset({0})
    assert guard.decide(B, left_out={0}) == frozenset({0})


def test_an_unmeasured_group_moves_nothing() -> None:
    guard = Guard(n_groups=2)
    guard.observe({0: GroupCost(0.01, 100.0)}, 0.0, active=2)
    assert guard.decide(B) == frozenset()
    assert math.isinf(guard.predicted_s([0, 1], B))


GUARDED = {
    "guard": True,
    "split_policy": "weighted",
    "rebalance_every": 2,
    "epochs": 2,
    "global_batch_size": 8,
}


FOUR_GROUPS = [{"name": n, "device_type": "cpu", "workers": 1} for n in "abcd"]
SHARDED_A = [  # b's two workers take their chunks of the global model back and gather them
    {"name": "a", "device_type": "cpu", "workers": 2, "sharding": "fsdp"},
    {"name": "b", "device_type": "cpu", "workers": 2},
]
# The tiny model with a buffer its forward moves in training, as BatchNorm's running mean,
# from any number of samples (the weighted split may give a worker one).
RUNNING_MODULE = """
import torch
from examples.tiny_regression import build_datasets, build_model as tiny, build_optimizer, loss_fn


class Running(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = tiny()
        self.register_buffer("seen", torch.zeros(self.net[0].in_features))

    def forward(self, x):
        if self.training:
            self.seen.mul_(0.9).add_(x.detach().mean(0), alpha=0.1)
        return self.net(x)


def build_model():
    return Running()
"""
THREE_GROUPS = FOUR_GROUPS[:3]


@pytest.mark.parametrize(
    ("schedule", "parked_name", "groups"),
    [
        ({4: [1], 10: []}, "b", None),  # the 1-worker group, then back
        ({4: [0], 12: []}, "a", None),  # the group of the first worker: the model's source moves
        # four leaders in a ring (worker.engine.ring): without b, a and c get a link of their own
        ({4: [1], 10: []}, "b", FOUR_GROUPS),
        # three leaders' ring, then two: a and c sum over their link's own allreduce
        ({4: [1], 10: []}, "b", THREE_GROUPS),
        # the parameter server in 3 shards sums the steps: each owner adds the stepping
        # groups' slices only, told which by rank 0
        ({4: [1], 10: []}, "b", {"groups": THREE_GROUPS, "ps_shards": 3}),
        # two groups and 2 shards: while b is parked a's sum is its own, no owner's
        ({4: [1], 10: []}, "b", {"ps_shards": 2}),
    ],
)
def test_a_parked_group_taken_back_keeps_sync_exact(
    make_spec: Callable[..., RunSpec],
    tmp_path: Path,
    schedule: dict[int, list[int]],
    parked_name: str,
    groups: list[dict[str, object]] | dict[str, object] | None,
) -> None:
    options = groups if isinstance(groups, dict) else {"groups": groups} if groups else {}
    spec = make_spec(
        **GUARDED,
        **options,
        debug_guard_schedule=schedule,
        checkpoint_every=6,  # a step checkpoint while the group is parked
        agreement_every=3,  # and agreement checks, which leave the parked replica out
        on_disagreement="fail",
    )
    run, _ = assert_matches_reference(spec, tmp_path / "dump")
    server = run.text(0)
    assert f"guard: group {parked_name!r} parked at step 4" in server
    assert f"guard: group {parked_name!r} taken back at step {max(schedule)}" in server


SLOW_UPDATE = """
import os

WORK = torch.randn(384, 384, generator=torch.Generator().manual_seed(0))


class SlowOnRank3(torch.optim.SGD):
    def step(self, closure=None):
        # group b's only worker: about 2.7 GFLOP per update, far beyond the others' whole
        # step even when a loaded host slows each rank unevenly (at 0.9 GFLOP it was not, 1
        # run in 3 beside two other test processes)
        if os.environ["RANK"] == "3":
            product = WORK
            for _ in range(24):
                product = torch.tanh(product @ WORK)
        return super().step(closure)


def build_optimizer(params):
    return SlowOnRank3(params, lr=0.02, momentum=0.9)
"""


@pytest.mark.parametrize(
    "strategy",
    [
        {"epochs": 1},
        # diloco's first check comes after its first round (warm): the guard still acts
        {"epochs": 2, "sync_strategy": "diloco", "sync_period": 2},
    ],
)
def test_the_guard_parks_a_group_whose_update_outlasts_the_step(
    make_spec: Callable[..., RunSpec], tmp_path: Path, strategy: dict[str, object]
) -> None:
    module = tmp_path / "slow_update.py"
    tiny = Path(__file__).resolve().parents[3] / "examples" / "tiny_regression.py"
    module.write_text(tiny.read_text() + SLOW_UPDATE)
    spec = make_spec(**{**GUARDED, "code": str(module), "global_batch_size": 16, **strategy})
    run, finals = run_with_dump(spec, tmp_path / "dump")
    server = run.text(0)
    assert "guard: group 'b' parked" in server, server[-3000:]
    assert "taken back" not in server  # its update stays as slow
    # The stepping group ends on the parameter server's model; the parked one kept its own.
    assert torch.equal(finals[1], finals[0]) and torch.equal(finals[2], finals[0])
    assert not torch.equal(finals[3], finals[0])


@pytest.mark.parametrize(
    ("strategy", "options"),
    [
        # periodic: the parked group skips its local steps and the averaging (the parameter
        # server averages the others' models only), and comes back with the global model
        ("periodic", {"sync_period": 2, "checkpoint_every": 6}),
        # diloco (blocking): it takes no local step and sends no pseudo-gradient (the outer
        # step is the other group's); taken back, it starts its rounds from the global model
        ("diloco", {"sync_period": 4, "checkpoint_every": 8}),
        # overlapped: the rounds at the guard's checks drain, so the group leaves and comes
        # back with no global model on its way
        ("diloco", {"sync_period": 4, "checkpoint_every": 8, "diloco_exchange": "overlapped"}),
        # async: the guard's checks are barriers; the server serves the stepping groups only
        ("diloco", {"sync_period": 4, "checkpoint_every": 8, "diloco_exchange": "async"}),
        # the parameter server in 3 shards over 3 groups: every owner sums the stepping
        # groups' slices only, told which by rank 0
        ("periodic", {"sync_period": 2, "ps_shards": 3, "groups": THREE_GROUPS}),
        (
            "diloco",
            {"sync_period": 4, "checkpoint_every": 8, "ps_shards": 3, "groups": THREE_GROUPS},
        ),
        # group a sharded: b, taken back, takes the global model from the parameter server's
        # owners (rank 0 alone with one shard; 2 owners for the overlapped diloco)
        ("periodic", {"sync_period": 2, "checkpoint_every": 6, "groups": SHARDED_A}),
        (
            "diloco",
            {
                "sync_period": 4,
                "checkpoint_every": 8,
                "diloco_exchange": "overlapped",
                "ps_shards": 2,
                "groups": SHARDED_A,
            },
        ),
    ],
)
def test_a_round_strategy_parks_a_group_and_takes_it_back(
    make_spec: Callable[..., RunSpec],
    tmp_path: Path,
    strategy: str,
    options: dict[str, int | str],
) -> None:
    if options.get("groups") is SHARDED_A:  # with a running buffer, which b takes back too
        module = tmp_path / "running_model.py"
        module.write_text(RUNNING_MODULE)
        options = {**options, "code": str(module)}
    spec = make_spec(
        **{**GUARDED, **options},
        sync_strategy=strategy,
        debug_guard_schedule={4: [1], 12: []},
    )
    run, finals = run_with_dump(spec, tmp_path / "dump")
    for rank in range(1, 1 + spec.n_workers):  # the parameter server's other shards hold none
        assert torch.equal(finals[rank], finals[0]), f"rank {rank} differs from the PS"
    assert_every_sample_once(spec, dumped_batches(tmp_path / "dump"))
    server = run.text(0)
    assert "guard: group 'b' parked at step 4" in server
    assert "guard: group 'b' taken back at step 12" in server
    val = [v for v in run.metrics("val_loss") if v is not None]
    assert len(val) == spec.epochs and all(math.isfinite(v) for v in val)
    if spec.any_sharded:
        # b's workers took the global model from the owners: rank 0's slice of it, the buffers
        server = torch.load(tmp_path / "dump" / "catch-up-0-12.pt", weights_only=True)
        head = server["params"]
        assert head.numel() > 0 and server["buffers"].numel() > 0
        for rank in spec.group_ranks("b"):
            taken = torch.load(tmp_path / "dump" / f"catch-up-{rank}-12.pt", weights_only=True)
            assert torch.equal(taken["params"][: head.numel()], head), rank
            assert torch.equal(taken["buffers"], server["buffers"]), rank
        # a checkpoint while b was parked keeps b's own optimizer state, which b kept: its
        # leader wrote it (not the first stepping worker's, a sharded one's rows)
        first = min(Path(spec.checkpoint_dir).glob("step-*.pt"), key=lambda p: p.stat().st_mtime)
        kept = torch.load(first, weights_only=True)
        assert 4 < kept["step"] < 12, kept["step"]
        folder = kept["group_optimizers"][1]["sharded_state"]["folder"]
        assert folder == f"{first.name}.g1.dcp", folder


def test_a_group_parked_across_epoch_ends_loses_no_sample(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    """Parked from step 4 to the end of 3 epochs: the others take every sample once an epoch
    (the split gives the parked worker none, also in the epochs that start with it parked),
    and the stepping ranks are the single-process steps on those batches."""
    spec = make_spec(**{**GUARDED, "debug_guard_schedule": {4: [1]}, "epochs": 3})
    run, finals = run_with_dump(spec, tmp_path / "dump")
    batches = dumped_batches(tmp_path / "dump")
    assert_every_sample_once(spec, batches)
    expected, _ = reference_run(spec, batches)
    for rank in (0, 1, 2):  # the parameter server and group a's two workers
        torch.testing.assert_close(finals[rank], expected, atol=1e-5, rtol=0)
    assert "taken back" not in run.text(0)


def test_the_guard_acts_on_every_diloco_exchange_and_not_on_quorum(
    make_spec: Callable[..., RunSpec],
) -> None:

    diloco = strategy_for("diloco")
    for exchange in ("blocking", "overlapped", "async"):
        spec = make_spec(sync_strategy="diloco", sync_period=4, diloco_exchange=exchange)
        assert diloco.guards(spec)
    assert not strategy_for("quorum").guards(make_spec(sync_strategy="quorum", quorum=1))


def test_rounds_are_priced_by_each_groups_rate_with_its_fixed_part() -> None:
    fast, slow = GroupCost(0.03, 690.0), GroupCost(0.12, 230.0)
    rate_fast, rate_slow = B / (0.03 + B / 690.0), B / (0.12 + B / 230.0)
    assert round_step_seconds([fast, slow], B) == pytest.approx(B / (rate_fast + rate_slow))
    guard = Guard(n_groups=2, rounds=True)
    guard.observe({0: fast, 1: slow}, 0.01, active=2)
    assert guard.decide(B) == frozenset()  # it adds its rate, and the exchange is cheap
    guard.observe({0: fast, 1: slow}, 0.2, active=2)  # the round's exchange waits for it
    assert guard.decide(B) == frozenset({1})


def test_a_set_that_ran_is_priced_as_measured_not_as_modelled() -> None:
    """diloco, 10M parameters, a group at a tenth of the other's speed. Both together ran
    1.4 times as long as modelled (the fast group's compute slowed beside the other, the
    waits for its rounds); the fast group alone ran as modelled. When the fast group later
    slows down, the model alone would take the slow group back; priced as it ran, the set
    with both still loses, so it stays parked. A set that has not run takes the running
    set's ratio, so a shortfall every set shares favours none."""
    fast, slow = GroupCost(0.035, 1430.0), GroupCost(0.47, 97.0)
    guard = Guard(n_groups=2, rounds=True)
    guard.observe({0: fast, 1: slow}, 0.02, active=2)
    both = guard.predicted_s([0, 1], B)
    guard.observe({0: fast, 1: slow}, 0.02, active=2, step_s=both * 1.4)
    guard.parked = guard.decide(B)
    assert guard.parked == frozenset({1}) and guard.bias[frozenset({0, 1})] == pytest.approx(1.4)
    alone = guard.predicted_s([0], B)
    guard.observe({0: fast}, 0.005, active=1, step_s=alone + 0.005)
    guard.parked = guard.decide(B)
    assert guard.parked == frozenset({1}) and guard.undone is None and alone > 0
    slowed = GroupCost(0.035, 300.0)
    guard.observe({0: slowed}, 0.005, active=1)
    guard.observe({0: slowed}, 0.005, active=1, step_s=guard.predicted_s([0], B))
    modelled_back = guard.predicted_s([0, 1], B)
    assert modelled_back <= guard.predicted_s([0], B) * (1 - guard.margin)  # the model: back
    assert guard.decide(B) == frozenset({1})  # as it ran: not
    assert guard.priced_s([0, 1], B) == pytest.approx(modelled_back * 1.4)


def test_a_park_the_next_window_does_not_bear_out_is_undone_and_not_repeated() -> None:
    # The prediction parks the slow group on the assumption that one group alone has no
    # overhead; the window after it measures a step no shorter than before: it comes back.
    fast, slow = GroupCost(0.01, 2000.0), GroupCost(0.03, 500.0)
    guard = Guard(n_groups=2)
    guard.observe({0: fast, 1: slow}, 0.02, active=2, step_s=0.0556)
    guard.parked = guard.decide(B)
    assert guard.parked == frozenset({1}) and guard.probation == (1, 0.0556)
    guard.observe({0: fast}, 0.03, active=1, step_s=0.072)  # measured: slower alone
    guard.parked = guard.decide(B)
    assert guard.parked == frozenset() and guard.undone == (0.0556, 0.072)
    # With the lone group's overhead now measured, the same costs park nothing again.
    guard.observe({0: fast, 1: slow}, 0.02, active=2, step_s=0.0556)
    assert guard.decide(B) == frozenset()


def test_a_park_the_next_window_bears_out_stays() -> None:
    fast, slow = GroupCost(0.03, 690.0), GroupCost(0.12, 230.0)
    guard = Guard(n_groups=2)
    guard.observe({0: fast, 1: slow}, 0.02, active=2, step_s=0.17)
    guard.parked = guard.decide(B)
    assert guard.parked == frozenset({1})
    guard.observe({0: fast}, 0.005, active=1, step_s=0.12)
    guard.parked = guard.decide(B)
    assert guard.parked == frozenset({1}) and guard.undone is None and guard.probation is None


def test_an_undone_park_is_not_tried_again_on_the_same_step() -> None:
    # Three groups: after the undo, the next window with all three overwrites the overhead
    # learnt from it; the veto keeps the guard from parking the same group every other check.
    costs = {0: GroupCost(0.01, 2000.0), 1: GroupCost(0.01, 2000.0), 2: GroupCost(0.2, 500.0)}
    guard = Guard(n_groups=3)
    guard.observe(costs, 0.03, active=3, step_s=0.23)
    guard.parked = guard.decide(B)
    assert guard.parked == frozenset({2})  # its update (0.2 s) outlasts the others' step
    guard.observe({0: costs[0], 1: costs[1]}, 0.21, active=2, step_s=0.24)  # no faster
    guard.parked = guard.decide(B)
    assert guard.parked == frozenset() and guard.vetoed == {2: 0.23}
    guard.observe(costs, 0.03, active=3, step_s=0.23)
    assert guard.decide(B) == frozenset()  # the same step as when it was undone
    guard.observe(costs, 0.03, active=3, step_s=0.30)  # 30 % slower since: tried again
    assert guard.decide(B) == frozenset({2})


@pytest.mark.parametrize(
    ("step_s", "expected"),
    [
        (None, GUARD_CHECK_STEPS),  # not profiled (a resumed attempt)
        (0.05, GUARD_CHECK_STEPS),  # short steps: 10 of them are still under 4 s
        (0.5, 8),  # 8 steps fill 4 s
        (1.0, 4),
        (2.2, 4),  # never fewer than 4: a window of fewer measures too roughly
    ],
)
def test_the_first_check_comes_after_the_steps_that_fill_four_seconds(
    step_s: float | None, expected: int
) -> None:
    assert guard_first_check_steps(step_s) == expected


def guarded_run(step_s: float | None, warm_at: int, **spec: object) -> SimpleNamespace:
    """What guard_due and guard_check read of a run: no rebalancing schedule unless given."""
    fields = {"split_policy": "weighted", "rebalance_every": 0, "debug_guard_schedule": None}
    return SimpleNamespace(
        spec=SimpleNamespace(**{**fields, **spec}),
        guard=Guard(2),
        step=0,
        last_balance=0,
        profiled_step_s=step_s,
        warm_at=warm_at,
    )


@pytest.mark.parametrize(("step_s", "first"), [(2.2, 4), (None, GUARD_CHECK_STEPS)])
def test_the_engine_checks_first_at_the_step_its_profile_sizes(
    step_s: float | None, first: int
) -> None:
    # Every rank holds the same profiled step, so every rank finds the same first check; it
    # counts from the attempt's warm point, the end of sync's second step.
    run = guarded_run(step_s, warm_at=2)
    due = [step for step in range(1, 14) if guard_due(run, step)]  # type: ignore[arg-type]
    assert due[0] == 2 + first
    run.guard.costs[0] = GroupCost(0.1, 100.0)  # measured: no more first checks
    assert not any(guard_due(run, step) for step in range(1, 14))  # type: ignore[arg-type]


def test_no_guard_check_judges_the_attempts_first_rounds() -> None:
    """diloco rounds of 16 steps: the first round's steps pay the optimizer's state and the
    gradients' first allocation (at 25M parameters on a third of a core, the first round took
    the slow group twice as long as its later rounds, and the guard parked it at step 16 for
    good), and the busy clock charges a group's first update to its next section, which is
    the second round's first for a group of one local step a round. A rebalancing check up
    to the second round's end (the warm point) neither parks nor keeps the window's costs;
    the next window counts from there."""
    run = guarded_run(2.2, warm_at=32, rebalance_every=10)
    due = [s for s in range(1, 33) if guard_due(run, s)]
    assert due[0] == 10 and 32 in due  # the balancer's marks: checks from there on
    run.step = 32
    assert window_start(run) == 0
    # (busy s, samples, own s, local steps, wall s) by worker: the slow one at 1.3 s a step
    cold = ([9.0, 2.0], [200.0, 40.0], [0.5, 5.0], [12.0, 4.0], [9.0, 9.0])
    assert not guard_check(run, cold)  # type: ignore[arg-type]
    assert not run.guard.costs and not run.guard.parked
    run.step = 36
    assert window_start(run) == 32  # every worker started a window at the warm point


def test_the_first_check_counts_from_the_warm_point() -> None:
    run = guarded_run(2.2, warm_at=32)  # no rebalancing schedule: the guard's own first check
    assert [s for s in range(1, 48) if guard_due(run, s)] == list(range(36, 48))


def test_the_guard_acts_beside_a_sharded_group_under_rounds_only(
    make_spec: Callable[..., RunSpec],
) -> None:
    both = [{**group, "sharding": "fsdp"} for group in SHARDED_A]
    cases = [
        ("periodic", SHARDED_A, True),  # b may be parked
        ("diloco", SHARDED_A, True),
        ("sync", SHARDED_A, False),  # b's return would take a sharded replica whole
        ("periodic", both, False),  # every group sharded: none to park
    ]
    for strategy, groups, acts in cases:
        spec = make_spec(**{**GUARDED, "groups": groups, "sync_strategy": strategy})
        run = SimpleNamespace(spec=spec, strategy=strategy_for(strategy))
        assert guarding(run) is acts, (strategy, groups)  # type: ignore[arg-type]
