"""Benchmark ``server_memory_ratio``: what the parameter server's rank 0 holds while training,
with its owners in S = 2 shards over one server (``ps_shards``, issue 36 item 2).

With S >= 2 under ``periodic`` and ``diloco`` the owners hold the global model between them:
rank 0 builds the model, sends each owner its slice, and keeps slice 0 (and, under
``diloco``, slice 0 of the outer optimizer's momentum) and the buffers; each checkpoint's
model is written by the owners, each its slice (docs/architecture.md, "A parameter server in
shards"). With one server rank 0 holds the whole model, and under ``diloco`` the outer
optimizer's parameter and momentum, all P elements each.

The engine trains bench/workloads/deep_mlp.py (256 -> H, 7 x (H -> H), H -> 10; Adam) on two
groups of one CPU worker each, ``diloco`` (or ``--strategy periodic``) with rounds of 4
steps, 3 epochs of 8 steps, a checkpoint at each epoch's end and ``final.pt``; one torch
thread a process. Arms: ``ps_shards`` 1, 2 and 4, one after the other, at each size.

Per arm, rank 0's memory, read from ``/proc/<pid>/status`` every 20 ms:

- ``training_mib``: the largest resident set (``VmRSS``) read after its first checkpoint was
  reported (the first epoch's end), so the start, where rank 0 builds the whole model
  (the user's ``build_model``) and sends it out, is not in it: what it holds while it
  trains, checkpoints included;
- ``peak_mib``: its peak resident set (``VmHWM``) over the whole run, the start included;
- ``baseline_mib``: the same ``training_mib`` at hidden width 16 (6k parameters: torch, the
  engine and gloo without a model to speak of), measured once per arm.

value (per size ``server_memory_ratio_<size>``, then the worst): rank 0's ``training_mib``
above its baseline with S = 2 over the same with S = 1; ``ratio_4_shards`` the same with S =
4. Ideal 1 / S: what rank 0 holds of the model and of its rounds falls with the shards, where
before it held the whole model whatever S (0.79 and 0.75 at 25M, 2026-12-01). Target: <= 0.6
at S = 2.

    python -m bench.server_memory [--sizes 25M,100M] [--strategy diloco|periodic]
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import emit, run_task, workload
from bench.workloads.deep_mlp import label, parameters, width

BASELINE_HIDDEN = 16
GLOBAL_BATCH, STEPS, EPOCHS, ROUND_STEPS = 32, 8, 3, 4
SHARDS = (1, 2, 4)
INTERVAL_S = 0.02
MIB = 2**20
TARGET = "<= 0.6"


def _status_kib(pid: int, field: str) -> int | None:
    """``field`` (``VmRSS``, ``VmHWM``) of process ``pid`` in KiB; None once it has exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


class ServerWatch:
    """Rank 0's memory through one run: pass it as ``on_spawn`` and as ``stop_when`` (it never
    stops the run; it notes when the first checkpoint is reported)."""

    def __init__(self) -> None:
        self.checkpointed: float | None = None
        self.training_kib = 0
        self.peak_kib = 0
        self._thread: threading.Thread | None = None

    def __call__(self, pids: dict[int, int]) -> None:
        self._thread = threading.Thread(target=self._poll, args=(pids[0],), daemon=True)
        self._thread.start()

    def event(self, event: dict[str, Any]) -> bool:
        if event.get("type") == "checkpoint" and self.checkpointed is None:
            self.checkpointed = time.monotonic()
        return False

    def _poll(self, pid: int) -> None:
        while True:
            rss, hwm = _status_kib(pid, "VmRSS"), _status_kib(pid, "VmHWM")
            if rss is None or hwm is None:
                return
            self.peak_kib = max(self.peak_kib, hwm)
            if self.checkpointed is not None:
                self.training_kib = max(self.training_kib, rss)
            time.sleep(INTERVAL_S)

    def figures(self) -> tuple[float, float]:
        """``(training_mib, peak_mib)`` once the run has ended; raises RuntimeError when no
        checkpoint was seen or rank 0 was never read after it."""
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.checkpointed is None or not self.training_kib:
            raise RuntimeError("rank 0 was not read after its first checkpoint")
        return self.training_kib / 1024, self.peak_kib / 1024


def server_run(hidden: int, shards: int, strategy: str) -> tuple[float, float, float]:
    """Rank 0's ``(training_mib, peak_mib, wall_s)`` in one run at hidden width ``hidden``."""
    watch = ServerWatch()
    run = run_task(
        {
            "code": workload("deep_mlp"),
            "epochs": EPOCHS,
            "global_batch_size": GLOBAL_BATCH,
            "groups": [
                {"name": "a", "device_type": "cpu", "workers": 1},
                {"name": "b", "device_type": "cpu", "workers": 1},
            ],
            "sync_strategy": strategy,
            "sync_period": ROUND_STEPS,
            "ps_shards": shards,
            "profile_steps": 2,
        },
        timeout_s=900,
        env={
            "POLYTRAIN_BENCH_HIDDEN": str(hidden),
            "POLYTRAIN_BENCH_ITEMS": str(GLOBAL_BATCH * STEPS),
        },
        on_spawn=watch,
        stop_when=watch.event,
    )
    training, peak = watch.figures()
    return training, peak, run.wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="25M,100M", help="of deep_mlp's sizes, or widths")
    parser.add_argument("--strategy", choices=["diloco", "periodic"], default="diloco")
    args = parser.parse_args()
    baseline = {s: server_run(BASELINE_HIDDEN, s, args.strategy)[0] for s in SHARDS}
    worst = 0.0
    sizes = args.sizes.split(",")
    for size in sizes:
        hidden = width(size)
        runs = {s: server_run(hidden, s, args.strategy) for s in SHARDS}
        above = {s: runs[s][0] - baseline[s] for s in SHARDS}
        ratio = above[2] / above[1]
        worst = max(worst, ratio)
        emit(
            f"server_memory_ratio_{label(size)}",
            round(ratio, 4),
            TARGET,
            ideal=0.5,
            parameters=parameters(hidden),
            model_mib=round(parameters(hidden) * 4 / MIB, 1),
            strategy=args.strategy,
            training_mib={s: round(runs[s][0], 1) for s in SHARDS},
            peak_mib={s: round(runs[s][1], 1) for s in SHARDS},
            baseline_mib={s: round(baseline[s], 1) for s in SHARDS},
            ratio_4_shards=round(above[4] / above[1], 4),
            run_s={s: round(runs[s][2], 1) for s in SHARDS},
        )
    emit("server_memory_ratio", round(worst, 4), TARGET, ideal=0.5, sizes=sizes)


if __name__ == "__main__":
    main()
