"""Benchmark ``sharded_memory_ratio``: peak memory per worker with ``sharding: fsdp`` over without.

With ``sharding: fsdp`` every worker of a group holds 1/W of the parameters, of their
gradients and of the optimizer state (worker/engine/fsdp.py); without, each holds all of
them. The engine trains bench/workloads/deep_mlp.py (256 -> H, 7 x (H -> H), H -> 10 with
ReLU; Adam: 16 bytes a parameter of parameters, gradients and two moments) on one group of
2 CPU workers, sync strategy, one torch thread per process: one epoch of 8 steps of a global
batch of 32 (16 per worker, so activations stay a few MiB), ``profile_steps`` 2, the
agreement check before training on. Two arms a size, back to back: **none** and **fsdp**
(the task's ``sharding``).

Peak memory of a rank: its peak resident set size, ``VmHWM`` in ``/proc/<pid>/status`` (the
kernel's high-water mark, it never falls), read every 20 ms from the moment the ranks start
(``launch_local``'s ``on_spawn``) until each exits, the last value read kept. The peak per
worker is the larger of the group's 2 workers'; the parameter server (rank 0) holds the
whole model and optimizer by design and is reported apart (``server_peak_mib``).

- value (per size ``sharded_memory_ratio_<size>``, then the summary ``sharded_memory_ratio``
  whose value is the worst size's): fsdp's peak per worker over none's. Ideal 0.5 plus
  activations and what a process holds without a model; target <= 0.6.
- ``ratio_above_baseline``: the same ratio with each arm's baseline taken off both peaks:
  the peak per worker of the same task at hidden width 16 (6k parameters: torch, the engine
  and gloo without a model to speak of, about 300 MiB a process), measured once per arm.
- ``state_mib``: the whole model's 16 bytes a parameter, what a worker holds without
  sharding; with it, half.
- ``torch_fsdp_peak_mib``: for reference, the larger peak of plain FSDP2's 2 ranks
  (bench/fsdp_vs_torch.py's, the same units) on the same batches, 8 steps: what FSDP2
  itself costs on this host, without the engine's parameter server, checks and checkpoint.

The allocator is glibc's. A sharded worker and its parameter server fix its mmap threshold
at 1 MiB themselves (worker/engine/fsdp.py ``return_freed_memory``); the unsharded arm and
plain FSDP2 keep glibc's default, which raises the threshold to the largest block freed (up
to 32 MiB), after which smaller blocks come from heaps that keep most of what is freed
resident. ``--mmap-threshold`` sets ``MALLOC_MMAP_THRESHOLD_`` (bytes) for every rank of
every run (a sharded rank's own setting still wins), to compare the arms under one setting.

Sizes: about 25M and 100M parameters. A run that fails (a rank exits non-zero, or the
run times out) ends the benchmark with exit code 1 and the ranks' last lines.

``--strategy periodic`` or ``diloco`` runs both arms with that strategy (rounds of
:data:`ROUND_STEPS` steps, 2 an epoch), where each worker of the sharded group sends the
parameter server only its own rows of a round (docs/heterogeneity.md, "Sharding inside a
group"); the lines are then named ``sharded_memory_ratio_<strategy>...``.

    python -m bench.sharded_memory [--sizes 25M,100M] [--mmap-threshold 1048576]
        [--strategy sync|periodic|diloco]
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import emit, run_task, workload
from bench.fsdp_vs_torch import torch_step_s
from bench.workloads.deep_mlp import WIDTHS, label, parameters, width

BASELINE_HIDDEN = 16
GLOBAL_BATCH, STEPS = 32, 8
ARMS = ("none", "fsdp")
INTERVAL_S = 0.02
MIB = 2**20
STATE_BYTES = 16  # a parameter, its gradient and Adam's two moments, float32
TARGET = "<= 0.6"
ROUND_STEPS = 4  # periodic's and diloco's sync_period: 2 rounds an epoch


def peak_kib(pid: int) -> int | None:
    """Peak resident set size (``VmHWM``) of process ``pid`` in KiB; None once it has exited
    (no such process, or a zombie, which has no memory left to report)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return None


class PeakWatch:
    """Every rank's peak memory: pass it as ``on_spawn``; it reads each rank's figure
    (``read(pid)`` in KiB, None once the rank has exited: by default its peak resident set
    size, :func:`peak_kib`) every :data:`INTERVAL_S` seconds until the rank exits and keeps
    the largest value read (:meth:`mib`, once the run has ended)."""

    def __init__(self, read: Callable[[int], float | None] | None = None) -> None:
        self.kib: dict[int, float] = {}
        self._read = read or peak_kib
        self._thread: threading.Thread | None = None

    def __call__(self, pids: dict[int, int]) -> None:
        self._thread = threading.Thread(target=self._poll, args=(dict(pids),), daemon=True)
        self._thread.start()

    def _poll(self, pids: dict[int, int]) -> None:
        while pids:
            for rank, pid in list(pids.items()):
                kib = self._read(pid)
                if kib is None:
                    del pids[rank]
                else:
                    self.kib[rank] = max(kib, self.kib.get(rank, 0.0))
            time.sleep(INTERVAL_S)

    def mib(self, ranks: int) -> dict[int, float]:
        """Peak MiB of ranks ``0 .. ranks - 1`` once they have exited; raises RuntimeError if
        the watch never started or a rank's peak was never read."""
        if self._thread is None:
            raise RuntimeError("the watch never started (on_spawn was not called)")
        self._thread.join(timeout=30)
        missing = [rank for rank in range(ranks) if rank not in self.kib]
        if self._thread.is_alive() or missing:
            raise RuntimeError(f"no peak read for ranks {missing} (or a rank still runs)")
        return {rank: self.kib[rank] / 1024 for rank in range(ranks)}


def peaks_of(
    hidden: int, sharding: str, env: dict[str, str], strategy: str = "sync"
) -> tuple[dict[int, float], float]:
    """Every rank's peak MiB in one run of the task at hidden width ``hidden`` with
    ``sharding`` and ``strategy`` (``env`` added to the ranks'), and the run's wall seconds;
    exits 1 if the run fails."""
    watch = PeakWatch()
    rounds = {} if strategy == "sync" else {"sync_period": ROUND_STEPS}
    run = run_task(
        {
            "code": workload("deep_mlp"),
            "epochs": 1,
            "global_batch_size": GLOBAL_BATCH,
            "groups": [{"name": "a", "device_type": "cpu", "workers": 2}],
            "sharding": sharding,
            "profile_steps": 2,
            "sync_strategy": strategy,
            **rounds,
        },
        timeout_s=900,
        env={
            "POLYTRAIN_BENCH_HIDDEN": str(hidden),
            "POLYTRAIN_BENCH_ITEMS": str(GLOBAL_BATCH * STEPS),
            **env,
        },
        on_spawn=watch,
    )
    return watch.mib(3), run.wall_s


def torch_peak(hidden: int, env: dict[str, str]) -> float:
    """The larger peak MiB of plain FSDP2's 2 ranks (bench/fsdp_vs_torch.py) training the
    same model on the same batches, one epoch; exits 1 if the run fails."""
    watch = PeakWatch()
    torch_step_s(hidden, batch=GLOBAL_BATCH, epochs=1, steps=STEPS, env=env, on_spawn=watch)
    return max(watch.mib(2).values())


def size_figures(
    params: int, peaks: dict[str, dict[int, float]], baseline: dict[str, float]
) -> dict[str, Any]:
    """One size's figures from each arm's peaks by rank (rank 0: the parameter server) and
    each arm's baseline peak per worker, in MiB: the ratio of the peaks per worker (the
    larger worker's), the same above the baselines, and the raw peaks."""
    worker = {arm: max(mib for rank, mib in peaks[arm].items() if rank != 0) for arm in ARMS}
    above = {arm: worker[arm] - baseline[arm] for arm in ARMS}
    return {
        "ratio": worker["fsdp"] / worker["none"],
        "ratio_above_baseline": round(above["fsdp"] / above["none"], 4),
        "peak_mib": {arm: round(worker[arm], 1) for arm in ARMS},
        "worker_peak_mib": {
            arm: [round(mib, 1) for rank, mib in sorted(peaks[arm].items()) if rank != 0]
            for arm in ARMS
        },
        "server_peak_mib": {arm: round(peaks[arm][0], 1) for arm in ARMS},
        "baseline_mib": {arm: round(baseline[arm], 1) for arm in ARMS},
        "state_mib": round(params * STATE_BYTES / MIB, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="25M,100M", help=f"of {list(WIDTHS)}, or hidden widths")
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        help="MALLOC_MMAP_THRESHOLD_ of every rank, bytes (default: glibc's own, adaptive)",
    )
    parser.add_argument(
        "--strategy",
        choices=["sync", "periodic", "diloco"],
        default="sync",
        help="both arms' sync_strategy (default sync)",
    )
    args = parser.parse_args()
    strategy = args.strategy
    prefix = "sharded_memory_ratio" + ("" if strategy == "sync" else f"_{strategy}")
    env = (
        {} if args.mmap_threshold is None else {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)}
    )
    sizes = args.sizes.split(",")
    baseline = {}
    for arm in ARMS:
        peaks, _ = peaks_of(BASELINE_HIDDEN, arm, env, strategy)
        baseline[arm] = max(peaks[1], peaks[2])
    worst: dict[str, float] = {"ratio": 0.0, "ratio_above_baseline": 0.0}
    for size in sizes:
        hidden = width(size)
        params = parameters(hidden)
        runs = {arm: peaks_of(hidden, arm, env, strategy) for arm in ARMS}
        figures = size_figures(params, {arm: runs[arm][0] for arm in ARMS}, baseline)
        worst = {k: max(v, figures[k]) for k, v in worst.items()}
        emit(
            f"{prefix}_{label(size)}",
            figures.pop("ratio"),
            TARGET,
            ideal=0.5,
            parameters=params,
            workers=2,
            **figures,
            torch_fsdp_peak_mib=round(torch_peak(hidden, env), 1),
            run_s={arm: round(runs[arm][1], 1) for arm in ARMS},
            mmap_threshold=args.mmap_threshold,
            strategy=strategy,
        )
    emit(
        prefix,
        worst["ratio"],
        TARGET,
        ideal=0.5,
        worst_above_baseline=worst["ratio_above_baseline"],
        sizes=[label(size) for size in sizes],
        workers=2,
        global_batch=GLOBAL_BATCH,
        optimizer="Adam",
        mmap_threshold=args.mmap_threshold,
        strategy=strategy,
    )


if __name__ == "__main__":
    main()
