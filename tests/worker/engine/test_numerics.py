"""Numerical faults fail loudly, or skip the step when asked, on real gloo processes.

A user module whose loss turns NaN at one step on one rank (two groups: ranks
1, 2 in group 'a', rank 3 in group 'b'; ``profile_steps`` 1, so training
step k is the (2 + k)-th call of ``loss_fn`` on a worker). With the default
``on_nonfinite: fail`` every rank must fail with a reason naming epoch, step,
rank and group, and no checkpoint may be written from the faulty step on;
with ``skip_step`` training goes on and the skip is counted. The fused
check-and-divide of a summed step vector is tested on its own (no processes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import torch
from torch import Tensor

from tests.worker.engine.reference import finite, run_with_dump
from worker.engine.local import LocalRun, launch_local
from worker.engine.numerics import all_finite, mean_gradient_
from worker.engine.run import Run
from worker.engine.spec import RunSpec
from worker.engine.state import ModelState
from worker.engine.strategy_sync import checked_update

NAN_LOSS = """
import os
import torch
from examples.tiny_regression import build_datasets, build_model, build_optimizer, loss_fn as mse

calls = 0

def loss_fn(output, target):
    global calls
    calls += 1
    loss = mse(output, target)
    if os.environ["RANK"] == "{rank}" and calls == 2 + {step}:
        return loss * float("nan")
    return loss
"""

# The loss stays finite but its gradient is NaN: d sqrt(u)/du is inf at u = 0, times 0.
NAN_GRADIENT = """
import os
from examples.tiny_regression import build_datasets, build_model, build_optimizer, loss_fn as mse

calls = 0

def loss_fn(output, target):
    global calls
    calls += 1
    loss = mse(output, target)
    if os.environ["RANK"] == "3" and calls == 2 + {step}:
        return loss + (output * 0).sqrt().sum()
    return loss
"""

DIST_TIMEOUT_S = 30


def user_spec(make_spec: Callable[..., RunSpec], tmp_path: Path, source: str, **kw: object):
    module = tmp_path / "user_code.py"
    module.write_text(source)
    # The call counts in the sources assume loss_fn runs for profiling and training only:
    # the agreement check's extra call on each group leader is left out here.
    return make_spec(code=str(module), profile_steps=1, on_disagreement="off", **kw)


def launch(spec: RunSpec) -> LocalRun:
    env = {"POLYTRAIN_DIST_TIMEOUT_S": str(DIST_TIMEOUT_S)}
    return launch_local(spec, env_extra=env, timeout_s=90.0, fail_grace_s=40.0)


def test_nan_loss_on_one_rank_fails_every_rank_naming_where(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    spec = user_spec(make_spec, tmp_path, NAN_LOSS.format(rank=2, step=5), checkpoint_every=2)
    run = launch(spec)
    assert not run.timed_out and all(c == 1 for c in run.returncodes.values()), run.returncodes
    reason = "non-finite loss and gradient on rank 2 (group 'a') at epoch 0, step 5"
    for rank in run.output:  # every rank fails on the fault itself, not on a lost peer
        assert f"NonFiniteError: {reason}" in run.text(rank), run.text(rank)
    assert not any(e["type"] == "done" for e in run.events)
    saved = [e for e in run.events if e["type"] == "checkpoint"]
    assert [e["step"] for e in saved] == [2, 4]  # the last good one is kept, none after
    state = torch.load(saved[-1]["path"], weights_only=True)
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_nan_loss_with_a_sharded_server_fails_the_server_and_workers_naming_where(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    """With the parameter server in shards (``ps_shards``) rank 0 takes part in every step's
    sum: it learns the workers' reason before the next step's, rather than losing a peer."""
    spec = user_spec(make_spec, tmp_path, NAN_LOSS.format(rank=3, step=3), ps_shards=2)
    run = launch(spec)
    assert not run.ok and not run.timed_out
    reason = "non-finite loss and gradient on rank 3 (group 'b') at epoch 0, step 3"
    for rank in range(1 + spec.n_workers):  # (the other owner just loses rank 0)
        assert f"NonFiniteError: {reason}" in run.text(rank), run.text(rank)
    assert not any(e["type"] in ("done", "checkpoint") for e in run.events)


def test_nan_loss_in_a_periodic_group_fails_it_naming_where(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    spec = user_spec(
        make_spec,
        tmp_path,
        NAN_LOSS.format(rank=3, step=3),
        sync_strategy="periodic",
        sync_period=4,
    )
    run = launch(spec)
    assert not run.ok and not run.timed_out
    reason = "NonFiniteError: non-finite loss and gradient on rank 3 (group 'b') at epoch 0, step 3"
    assert reason in run.text(3), run.text(3)
    assert not any(e["type"] == "checkpoint" for e in run.events)


def test_skip_step_skips_everywhere_and_counts(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    spec = user_spec(make_spec, tmp_path, NAN_GRADIENT.format(step=4), on_nonfinite="skip_step")
    run, finals = run_with_dump(spec, tmp_path / "dump")
    assert all(torch.equal(finals[r], finals[0]) for r in finals)
    assert finite(run.metrics("skipped_steps")) == [1.0, 0.0]
    assert all(math.isfinite(v) for v in finite(run.metrics("train_loss")))
    # Under sync every worker sees the global sum; the first worker logs the skip, once.
    skipped = [
        line for rank in run.output for line in run.output[rank] if "skipped the optimizer" in line
    ]
    assert len(skipped) == 1 and "gradient on rank 3 (group 'b') at epoch 0, step 4" in skipped[0]


def test_skip_step_with_periodic_quorum_and_diloco_sync(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    for options in (
        {"sync_strategy": "periodic", "sync_period": 3},
        {"sync_strategy": "quorum", "quorum": 1},
        {"sync_strategy": "diloco", "sync_period": 3},
    ):
        name = str(options["sync_strategy"])
        spec = user_spec(
            make_spec,
            tmp_path,
            NAN_LOSS.format(rank=2, step=6),
            on_nonfinite="skip_step",
            **options,
        )
        run, finals = run_with_dump(spec, tmp_path / name)
        assert all(torch.isfinite(f).all() for f in finals.values()), name
        assert finite(run.metrics("skipped_steps")) == [1.0, 0.0], name
        assert all(math.isfinite(v) for v in finite(run.metrics("train_loss"))), name


def test_all_finite_sees_every_nonfinite_element_and_no_overflow() -> None:
    assert all_finite(torch.tensor([1.0, -2.0, 3.5]))
    assert all_finite(torch.tensor([3e38, 3e38]))  # the sum overflows, the values do not
    for bad in (math.nan, math.inf, -math.inf):
        assert not all_finite(torch.tensor([1.0, bad, 2.0])), bad
    assert not all_finite(torch.tensor([math.inf, -math.inf]))


def step_vector(dtype: torch.dtype = torch.float32, count: float = 7.0) -> tuple[Tensor, int]:
    """A summed step vector ``[grad_sum (1000), buffer_change_sum (5), loss_sum, count]``."""
    torch.manual_seed(0)
    grads, buffers = torch.randn(1000, dtype=dtype) * 100, torch.randn(5, dtype=dtype)
    tail = torch.tensor([3.25, count], dtype=dtype)
    return torch.cat([grads, buffers, tail]), 1000


def test_mean_gradient_is_the_division_and_flags_every_nonfinite_element() -> None:
    for dtype, rtol in ((torch.float32, 1e-6), (torch.float64, 1e-15)):
        total, n = step_vector(dtype)
        fused = total.clone()
        assert mean_gradient_(fused, n)
        torch.testing.assert_close(fused[:n], total[:n] / 7, rtol=rtol, atol=0)
        assert torch.equal(fused[n:], total[n:])  # buffer changes, loss and count untouched
        for where in (0, 517, n - 1, n, n + 4, -2, -1):  # gradient, buffers, loss, count
            for bad in (math.nan, math.inf, -math.inf):
                faulty = total.clone()
                faulty[where] = bad
                assert not mean_gradient_(faulty, n), (dtype, where, bad)


def test_mean_gradient_huge_finite_values_and_a_step_without_samples() -> None:
    huge = torch.full((1006,), 3e38)  # the sum overflows, no value does
    huge[-1] = 2.0
    assert mean_gradient_(huge, 1000) and torch.equal(huge[:1000], torch.full((1000,), 1.5e38))
    empty, n = step_vector(count=0.0)
    empty[:n] = 0
    assert mean_gradient_(empty, n) and torch.equal(empty[:n], torch.zeros(n))
    empty[3] = math.nan
    assert not mean_gradient_(empty, n)


def test_checked_update_leaves_a_nonfinite_step_unapplied() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    state = ModelState.of(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    run = cast(
        Run,
        SimpleNamespace(
            state=state, params=state.params, optimizer=optimizer, buffer_base=None, reducer=None
        ),
    )
    before = state.vector()
    total = torch.cat([torch.ones(state.n_params + state.n_buffers), torch.tensor([1.0, 2.0])])
    total[state.n_params + 1] = math.inf  # a buffer change
    assert checked_update(total.clone(), run) == (False, 0.0, 0)
    total[state.n_params + 1] = 0.0
    total[2] = math.nan  # a gradient
    assert checked_update(total.clone(), run) == (False, 0.0, 0)
    assert torch.equal(state.vector(), before) and all(p.grad is None for p in state.params)
    total[2] = 1.0
    assert checked_update(total, run) == (True, 1.0, 2)
    moved = before[: state.n_params] - 0.1 * 0.5  # lr * the mean gradient 1 / 2
    torch.testing.assert_close(state.vector()[: state.n_params], moved)


def test_fused_mean_works_whatever_the_default_dtype_user_code_chose() -> None:
    """User code may call torch.set_default_dtype(torch.float64) and keep a float32 model."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        total = torch.tensor([3.0, 6.0, 0.5, 3.0], dtype=torch.float32)
        assert mean_gradient_(total, 2)
        assert torch.allclose(total[:2], torch.tensor([1.0, 2.0], dtype=torch.float32))
    finally:
        torch.set_default_dtype(previous)
