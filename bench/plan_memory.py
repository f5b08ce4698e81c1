"""Benchmark ``plan_memory_error``: a plan's predicted peak memory per worker against the task's.

A plan fits the model into each group's memory from what its trial measured
(backend/plans/performance.py, ``GroupModel.memory_mb``; docs/architecture.md, "Plans"):
whole, sharded (``fsdp``), or with a group's share capped. A prediction that is short lets a
task through that then fails its ``memory_limit_mb``; one that is long shards or caps a
group for nothing. This measures both on bench/workloads/deep_mlp.py (Adam) on one group of
2 CPU workers, sync, global batch 32:

1. the plan's trial (the engine option ``trial``, as a plan runs it: local batch sizes 8,
   16 and 32, 3 timed steps each, whole and sharded), fitted by
   ``backend.plans.performance.fit``;
2. the task itself, 1 epoch of 8 steps, ``sharding: none`` then ``fsdp``, each worker's
   peak data memory read every 20 ms through its pid as the trial reads its own
   (``worker.engine.memory``: ``VmData + VmHWM - VmRSS``, the largest value read).

Per arm: the predicted peak a worker at its share (16), the measured peak (the larger
worker's) and ``error`` = predicted / measured - 1. The value is the arm whose error is
furthest from 0; the target is a prediction never short (error >= 0) and within 20 % (a
10 % margin of the allocator's run-to-run spread, measured 765-877 MiB for the same sharded
step at 50M parameters, on top of the engine's work outside the trial's step).

    python -m bench.plan_memory [--size 25M]
"""

from __future__ import annotations

import argparse
from typing import Any

from backend.plans import performance
from bench.common import emit, run_task, workload
from bench.sharded_memory import PeakWatch
from bench.workloads.deep_mlp import WIDTHS, label, parameters, width
from contracts.trial import TrialResult
from worker.engine.memory import data_peak_mib, status_kib

GLOBAL_BATCH, STEPS, WORKERS = 32, 8, 2
ARMS = ("none", "fsdp")
TARGET = "0 <= error <= 0.2 (predicted / measured peak data memory a worker - 1)"


def data_peak_kib(pid: int) -> float | None:
    """Process ``pid``'s peak data memory in KiB now (None once it has exited)."""
    kib = status_kib(pid)
    return None if kib is None else data_peak_mib(kib) * 1024


def _fields(hidden: int) -> tuple[dict[str, Any], dict[str, str]]:
    spec = {
        "code": workload("deep_mlp"),
        "epochs": 1,
        "global_batch_size": GLOBAL_BATCH,
        "groups": [{"name": "a", "device_type": "cpu", "workers": WORKERS}],
        "profile_steps": 2,
    }
    env = {
        "POLYTRAIN_BENCH_HIDDEN": str(hidden),
        "POLYTRAIN_BENCH_ITEMS": str(GLOBAL_BATCH * STEPS),
    }
    return spec, env


def predicted(hidden: int) -> dict[str, float]:
    """The plan's predicted peak MiB of a worker at its share, per arm, from a trial run."""
    spec, env = _fields(hidden)
    trial = {"batch_sizes": [8, 16, 32], "steps": 3, "repeats": 2}
    run = run_task({**spec, "trial": trial}, timeout_s=900, env=env)
    event = next(e for e in run.events if e["type"] == "trial")
    model = performance.fit(
        TrialResult.model_validate(event["result"]),
        [("a", "cpu", WORKERS)],
        sync_strategy="sync",
    )
    group = model.groups[0]
    share = GLOBAL_BATCH // WORKERS
    found = {arm: group.memory_mb(share, WORKERS, arm) for arm in ARMS}
    if any(v is None for v in found.values()):
        raise SystemExit(f"the trial measured no memory: {found}")
    return {arm: float(v or 0.0) for arm, v in found.items()}


def measured(hidden: int, sharding: str) -> float:
    """The larger worker's peak data memory in MiB over one run of the task."""
    spec, env = _fields(hidden)
    watch = PeakWatch(data_peak_kib)
    run_task({**spec, "sharding": sharding}, timeout_s=900, env=env, on_spawn=watch)
    peaks = watch.mib(WORKERS + 1)
    return max(mib for rank, mib in peaks.items() if rank != 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="25M", help=f"of {list(WIDTHS)}, or a hidden width")
    args = parser.parse_args()
    hidden = width(args.size)
    guess = predicted(hidden)
    real = {arm: measured(hidden, arm) for arm in ARMS}
    # Rounded once: `met` judges the errors the line reports (judged unrounded, an error of
    # -0.00003 reported as -0.0 was "not met" beside its own line's 0.0).
    errors = {arm: round(guess[arm] / real[arm] - 1, 4) for arm in ARMS}
    worst = max(ARMS, key=lambda arm: abs(errors[arm]))
    emit(
        "plan_memory_error",
        errors[worst],
        TARGET,
        size=label(args.size),
        parameters=parameters(hidden),
        workers=WORKERS,
        worst_arm=worst,
        errors=errors,
        predicted_mib={arm: round(v, 1) for arm, v in guess.items()},
        measured_mib={arm: round(v, 1) for arm, v in real.items()},
        met=all(0 <= e <= 0.2 for e in errors.values()),
    )


if __name__ == "__main__":
    main()
