"""Shared helpers of the benchmarks: the JSON result line and engine runs on this host."""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import statistics
import sys
import tempfile
import time
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


def run_processes(
    targets: list[tuple[Callable[..., None], tuple[Any, ...]]], timeout_s: float
) -> list[Any]:
    """Run each ``(function, args)`` in a spawned process (a fresh interpreter, as a rank)
    and return what each puts on the queue passed as its last argument, in arrival order.

    Raises RuntimeError when a process exits without its result, fails, or the results do
    not all arrive within ``timeout_s`` seconds; every process is reaped (killed if it
    lingers) before this returns or raises.
    """
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, out)) for fn, args in targets]
    for proc in procs:
        proc.start()
    results: list[Any] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(procs):
            try:
                results.append(out.get(timeout=1.0))
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"a process failed (exit codes {failed})") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no result within {timeout_s:.0f} s") from None
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if any(proc.exitcode for proc in procs):
        raise RuntimeError(f"a process failed (exit codes {[p.exitcode for p in procs]})")
    return results
