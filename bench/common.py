"""Shared helpers of the benchmarks: the JSON result line and engine runs on this host."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def mean(values: list[float]) -> float:
    """Arithmetic mean (raises StatisticsError on an empty list)."""
    return statistics.fmean(values)


def cores() -> int:
    """CPU cores this process may use."""
    return len(os.sched_getaffinity(0))
