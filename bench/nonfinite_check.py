"""Benchmark ``nonfinite_check_cost``: what detecting a non-finite step costs the update.

The parameter server's update of a ``sync`` step (and a ``periodic`` group
member's, the same code) on a summed step vector ``[grad_sum (P),
buffer_change_sum (B), loss_sum, count]``: divide by the count,
``vector_to_grads``, one step of SGD with momentum 0.9, ``zero_grad``.
Timed, side by side in one process on one torch thread (as a rank has),
with the repetitions interleaved (the order rotates every repetition):

- ``plain``: the update without any detection, as it was before detection
  existed: ``grad_sum / count`` (a new tensor), then the step.
- ``fused``: the engine's update with detection
  (:func:`worker.engine.strategy_sync.checked_update`): the division is done
  in place by ``torch.amp.GradScaler``'s unscale-and-check kernel, which
  flags non-finite elements in the same pass
  (:func:`worker.engine.numerics.mean_gradient_`).
- ``old``: the detection this replaced: one ``sum`` over the whole vector
  (:func:`worker.engine.numerics.all_finite`), then ``plain``.
- ``inplace``: no detection and an in-place ``div_`` (the cheapest division;
  ``fused`` ÷ ``inplace`` is what the check itself costs in the fused pass).
- ``quorum_check``: a ``quorum`` group member still checks the group's raw
  sum with :func:`all_finite` before sending it (the parameter server, not
  the member, divides it), so that sum is timed alone and reported against
  ``plain``.

- ``compute``: one worker's forward and backward pass on its share of the
  step (128 of the 256 samples, as in a group of 2): with ``inplace`` it is the
  least a step costs (no exchange counted), the denominator below.

- ``fused_pass`` and ``inplace_pass``: the division pass alone, with the
  check (:func:`worker.engine.numerics.mean_gradient_`) and without it (an
  in-place ``div_``): the only part in which ``fused`` and ``inplace`` differ,
  timed alone so the rest of the update adds no noise to the difference.

Value: what detection adds to a step, the worst over the sizes of
``median(fused_pass) - median(inplace_pass)`` (the check's own cost, against
the cheapest division without it) divided by the step (median ``compute`` +
median ``inplace``); ideal 0.0, target <= 0.01 (1 % of a step, below the
spread of step times). The spread given is that of the per-repetition
differences. ``fused / plain`` (the engine's update before and after
this change), ``fused / inplace`` and ``old / plain`` are reported beside it.
Models: two-layer MLPs of about 4.2M and 25M parameters (plus a BatchNorm1d
whose buffers ride along).

    python -m bench.nonfinite_check [--reps 31]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import torch

from bench.common import emit
from worker.engine.exchange import vector_to_grads
from worker.engine.numerics import all_finite, mean_gradient_
from worker.engine.run import Run
from worker.engine.state import ModelState
from worker.engine.strategy_sync import apply_update, checked_update

# (name, widths): Linear(w0, w1), Tanh, Linear(w1, w2), BatchNorm1d(w2).
SIZES = (("4.2M", (1024, 2048, 1024)), ("25M", (2500, 5000, 2500)))
COUNT = 256  # samples of the step
WORKER_BATCH = COUNT // 2  # one worker's share in a group of 2
WARMUP = 3


def make_run(widths: tuple[int, int, int]) -> Run:
    """The parameter server's side of a run: model state, SGD with momentum, no buffer base."""
    torch.manual_seed(0)
    a, b, c = widths
    model = torch.nn.Sequential(
        torch.nn.Linear(a, b), torch.nn.Tanh(), torch.nn.Linear(b, c), torch.nn.BatchNorm1d(c)
    )
    state = ModelState.of(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    return cast(
        Run,
        SimpleNamespace(
            state=state,
            params=state.params,
            optimizer=optimizer,
            buffer_base=None,
            model=model,
            inputs=torch.randn(WORKER_BATCH, a),
        ),
    )


def plain_update(total: torch.Tensor, run: Run) -> None:
    """The update without detection, as before it existed: a new ``grad_sum / count`` tensor."""
    assert run.optimizer is not None
    n_params, count = run.state.n_params, int(round(float(total[-1])))
    vector_to_grads(total[:n_params] / count, run.params)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.state.add_mean_change(run.buffer_base, total[n_params:-2], count)


def old_update(total: torch.Tensor, run: Run) -> None:
    """Detection as it was: one sum over the whole vector, then the plain update."""
    if all_finite(total):
        plain_update(total, run)


def fused_update(total: torch.Tensor, run: Run) -> None:
    """The engine's update: check folded into the in-place division."""
    finite, _, _ = checked_update(total, run)
    assert finite


def inplace_update(total: torch.Tensor, run: Run) -> None:
    """No detection, in-place division: the cheapest update."""
    total[: run.state.n_params].div_(float(total[-1]))
    apply_update(total, run)


def worker_compute(total: torch.Tensor, run: Run) -> None:
    """The forward and backward pass of one worker's share (``WORKER_BATCH`` samples) of the
    step: the least a step of a 2-worker group costs besides the exchange and the update."""
    model = cast(Any, run).model
    model.zero_grad(set_to_none=True)
    model(cast(Any, run).inputs).square().mean().backward()


def fused_pass(total: torch.Tensor, run: Run) -> None:
    """The division pass alone, with the check: what ``fused`` does beyond ``inplace``."""
    assert mean_gradient_(total, run.state.n_params)


def inplace_pass(total: torch.Tensor, run: Run) -> None:
    """The division pass alone, without a check (in place)."""
    total[: run.state.n_params].div_(float(total[-1]))


def quorum_check(total: torch.Tensor, run: Run) -> None:
    """A quorum member's check of the group's raw sum before it sends it."""
    assert all_finite(total)


VARIANTS: dict[str, Callable[[torch.Tensor, Run], None]] = {
    "plain": plain_update,
    "fused": fused_update,
    "old": old_update,
    "inplace": inplace_update,
    "quorum_check": quorum_check,
    "compute": worker_compute,
    "fused_pass": fused_pass,
    "inplace_pass": inplace_pass,
}


def measure(widths: tuple[int, int, int], reps: int) -> tuple[dict[str, list[float]], int]:
    """Seconds of each variant per repetition (after ``WARMUP`` unrecorded ones), and P."""
    run = make_run(widths)
    n_params, n_buffers = run.state.n_params, run.state.n_buffers
    generator = torch.Generator().manual_seed(1)
    source = torch.cat(
        [
            torch.randn(n_params, generator=generator) * COUNT,
            torch.randn(n_buffers, generator=generator) * 1e-3,
            torch.tensor([0.5 * COUNT, float(COUNT)]),
        ]
    )
    total = torch.empty_like(source)
    names = list(VARIANTS)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(WARMUP + reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            total.copy_(source)  # the update consumes its vector (in place)
            started = time.perf_counter()
            VARIANTS[name](total, run)
            seconds = time.perf_counter() - started
            if rep >= WARMUP:
                times[name].append(seconds)
    return times, n_params


def summary(ratios: list[float]) -> dict[str, Any]:
    """Median, quartiles, min and max of per-repetition ratios."""
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return {
        "median": round(median, 4),
        "iqr": [round(q1, 4), round(q3, 4)],
        "min": round(min(ratios), 4),
        "max": round(max(ratios), 4),
    }


def ratios(times: dict[str, list[float]], name: str, base: str = "plain") -> list[float]:
    return [a / b for a, b in zip(times[name], times[base], strict=True)]


def ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=31)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines: list[dict[str, Any]] = []
    for label, widths in SIZES:
        times, n_params = measure(widths, args.reps)
        fused = summary(ratios(times, "fused"))
        step = statistics.median(times["compute"]) + statistics.median(times["inplace"])
        added = [f - i for f, i in zip(times["fused_pass"], times["inplace_pass"], strict=True)]
        per_rep = summary([a / step for a in added])
        added_over_step = round(
            (statistics.median(times["fused_pass"]) - statistics.median(times["inplace_pass"]))
            / step,
            4,
        )
        lines.append(
            emit(
                f"nonfinite_check_cost_{label}",
                added_over_step,
                "<= 0.01 (ideal 0.0)",
                params=n_params,
                added_over_step={
                    "difference_of_medians": added_over_step,
                    "per_rep_iqr": per_rep["iqr"],
                    "per_rep_min": per_rep["min"],
                    "per_rep_max": per_rep["max"],
                },
                step_ms=round(step * 1e3, 3),
                fused_over_plain=fused,
                old_over_plain=summary(ratios(times, "old")),
                fused_over_inplace=summary(ratios(times, "fused", "inplace")),
                quorum_check_over_plain=summary(ratios(times, "quorum_check")),
                median_ms={name: ms(values) for name, values in times.items()},
                reps=args.reps,
                threads=1,
            )
        )
    worst = max(lines, key=lambda line: line["value"])
    emit(
        "nonfinite_check_cost",
        worst["value"],
        "<= 0.01 (ideal 0.0)",
        worst_size=worst["benchmark"].rsplit("_", 1)[1],
        by_size={
            line["benchmark"].rsplit("_", 1)[1]: {
                "added_over_step": line["value"],
                "added_spread": line["added_over_step"]["per_rep_iqr"],
                "fused_over_inplace": line["fused_over_inplace"]["median"],
                "fused_over_plain": line["fused_over_plain"]["median"],
                "old_over_plain": line["old_over_plain"]["median"],
                "median_ms": line["median_ms"],
            }
            for line in lines
        },
    )
    emit(
        "quorum_check_cost",
        max(line["quorum_check_over_plain"]["median"] for line in lines),
        "report only (a quorum member's sum check ÷ the parameter server's plain update)",
        by_size={
            line["benchmark"].rsplit("_", 1)[1]: {
                **line["quorum_check_over_plain"],
                "check_ms": line["median_ms"]["quorum_check"],
                "update_ms": line["median_ms"]["plain"],
            }
            for line in lines
        },
    )


if __name__ == "__main__":
    main()
