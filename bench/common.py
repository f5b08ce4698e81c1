"""Shared helpers of the benchmarks: the JSON result line and engine runs on this host."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from worker.engine.compute import local_gradient
from worker.engine.contract import load_training_code
from worker.engine.data import stack_dataset
from worker.engine.emulation import affine_pace, calibrate_pace
from worker.engine.local import LocalRun, StopWhen, launch_local
from worker.engine.spec import RunSpec

WORKLOADS = Path(__file__).resolve().parent / "workloads"


def emit(benchmark: str, value: float, target: str, **raw: Any) -> dict[str, Any]:
    """Print the benchmark's one JSON line: name, value, target and the raw figures."""
    line = {"benchmark": benchmark, "value": round(value, 4), "target": target, **raw}
    print(json.dumps(line), flush=True)
    return line


def workload(name: str) -> str:
    """Absolute path of a training-code module in bench/workloads/."""
    return str(WORKLOADS / f"{name}.py")


def calibrated_pace(name: str, sizes: list[int], repeats: int = 15) -> list[tuple[int, float]]:
    """This host's undisturbed seconds of one forward/backward of workload ``name`` per size.

    The section the engine times (``local_gradient`` on random training
    samples), on one torch thread as every rank runs, measured once before a
    benchmark's runs (:func:`worker.engine.emulation.calibrate_pace`) and given
    to all of them as ``emulation_pace``, so that every emulated group keeps
    one speed through the whole benchmark. Returns ``(samples, seconds)`` pairs
    on the Theil-Sen line through the timings (``affine_pace``): repeated
    calibrations here differ by 5-10 % at single sizes, and the benchmarks'
    ratios compare sections of different sizes, so one noisy size would set
    them; the line is what an emulated device's cost is taken to be.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = load_training_code(workload(name))
        torch.manual_seed(0)
        model = code.build_model()
        data = stack_dataset(code.build_datasets()[0])
        generator = torch.Generator().manual_seed(0)

        def section(b: int) -> None:
            indices = torch.randint(0, len(data), (b,), generator=generator)
            local_gradient(code, model, data, indices, torch.device("cpu"))

        return [(b, round(t, 6)) for b, t in affine_pace(calibrate_pace(section, sizes, repeats))]
    finally:
        torch.set_num_threads(threads)


def add_pace_option(parser: argparse.ArgumentParser) -> None:
    """``--pace fixed|recent``: how the benchmark's emulated groups get their speed."""
    parser.add_argument(
        "--pace",
        choices=["fixed", "recent"],
        default="fixed",
        help="emulated speed: calibrated once for every run (fixed, default) or each "
        "worker's own fastest recent sections (recent)",
    )


def pace_option(args: argparse.Namespace, name: str, sizes: list[int]) -> Any:
    """The ``emulation_pace`` of every run: calibrated now for ``--pace fixed``, else None."""
    return calibrated_pace(name, sizes) if args.pace == "fixed" else None


def run_task(
    spec_fields: dict[str, Any],
    timeout_s: float = 600.0,
    *,
    env: dict[str, str] | None = None,
    on_spawn: Callable[[dict[int, int]], None] | None = None,
    stop_when: StopWhen | None = None,
) -> LocalRun:
    """Run one task on 127.0.0.1 (one torch thread per process); exits 1 if it fails.

    ``env`` is added to every rank's environment; ``on_spawn`` and ``stop_when`` go to
    :func:`worker.engine.local.launch_local` (placing ranks in CPU cgroups, watching events).
    """
    with tempfile.TemporaryDirectory(prefix="polytrain-bench-") as tmp:
        spec = RunSpec.model_validate(
            {"task_id": 0, "seed": 0, "checkpoint_dir": str(Path(tmp) / "ck"), **spec_fields}
        )
        run = launch_local(
            spec,
            timeout_s=timeout_s,
            env_extra={"POLYTRAIN_NUM_THREADS": "1", **(env or {})},
            on_spawn=on_spawn,
            stop_when=stop_when,
        )
    if not run.ok:
        for rank in run.output:
            print(f"--- rank {rank}\n" + "\n".join(run.output[rank][-30:]), file=sys.stderr)
        sys.exit(1)
    return run


def ps_metric(run: LocalRun, name: str) -> list[float]:
    """Per-epoch values of a parameter-server metric (non-finite ones dropped)."""
    return [v for v in run.metrics(name, rank=0) if v is not None]


def idle_fractions(run: LocalRun, ranks: range) -> list[list[float]]:
    """Per compute rank, ``idle_fraction`` of each epoch after the first (which warms up)."""
    return [
        [round(v, 3) for v in run.metrics("idle_fraction", rank=r)[1:] if v is not None]
        for r in ranks
    ]


def mean(values: list[float]) -> float:
    """Arithmetic mean (raises StatisticsError on an empty list)."""
    return statistics.fmean(values)


def cores() -> int:
    """CPU cores this process may use."""
    return len(os.sched_getaffinity(0))
