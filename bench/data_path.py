"""Benchmarks of the data path (docs/benchmarks.md): ``data_path_ratio`` and ``worker_rss_ratio``.

``data_path_ratio``: epoch time on the in-memory path over epoch time on the streaming
path, same model, data and seed: ``examples/mnist_cnn.py`` (4,000 MNIST digits in a
TensorDataset, a small CNN), one group of 2 workers, global batch 128 (32 steps an
epoch), 3 epochs; the streaming path with the engine's loader settings (for a
TensorDataset without preprocessing: no loader process, each step's batch read through
the DataLoader in the worker, one index per tensor). ``data_path_ratio_1_loaders`` is
the same with one DataLoader process per worker reading 2 batches ahead (batches then
cross processes through shared memory, and on this 2-core host the loaders take CPU
from the compute). Epoch time is the parameter server's ``epoch_time_s``
(validation excluded) of the epochs after the first (which starts the loader processes
and warms up). The two paths run alternately ``--rounds`` times; the value is the ratio
of the medians, with every epoch time reported. Ideal 1.0 (streaming costs nothing);
target >= 0.9. Processes: the parameter server (mostly waiting), 2 workers and, with
loaders, their 2 loader processes, on this 2-core host.

``worker_rss_ratio``: the memory of one worker training on a 2 GB memory-mapped array
over the same worker on a 20 MB one (``examples/memmap_regression.py``, files written by
``scripts/make_datasets.py``), one group of 1 worker, global batch 256, streaming with
one loader process, each run stopped after ``--seconds`` of training. Memory is sampled
every 0.2 s from ``/proc/PID/smaps_rollup`` of the worker's rank process and its loader
processes: the value compares the peak of their summed private memory (``Pss_Anon +
Pss_Shmem``: heap, tensors, batches in flight between loader and worker), the resident
pages of the mapped file (``Pss_File``, page cache the kernel reclaims) are reported
beside it, as is the rank process's own peak RSS. Ideal 1.0 (memory does not grow with
the dataset); target <= 1.5.

    python -m bench.data_path [--rounds 3] [--seconds 25] [--keep DIR]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import emit, ps_metric, run_task
from worker.engine.local import launch_local
from worker.engine.spec import RunSpec

ROOT = Path(__file__).resolve().parents[1]
MAKE_DATASETS = ROOT / "scripts" / "make_datasets.py"


def data_path_ratio(rounds: int, num_workers: int | None = None) -> dict[str, Any]:
    """Epoch times of both paths, alternating; emits ``data_path_ratio``."""
    times: dict[str, list[float]] = {"memory": [], "streaming": []}
    for _ in range(rounds):
        for path in ("memory", "streaming"):
            run = run_task(
                {
                    "code": "example:mnist_cnn",
                    "epochs": 3,
                    "global_batch_size": 128,
                    "groups": [{"name": "a", "device_type": "cpu", "workers": 2}],
                    "data": {"path": path, "num_workers": num_workers},
                }
            )
            times[path] += ps_metric(run, "epoch_time_s")[1:]
    memory, streaming = statistics.median(times["memory"]), statistics.median(times["streaming"])
    name = "data_path_ratio" if num_workers is None else f"data_path_ratio_{num_workers}_loaders"
    return emit(
        name,
        memory / streaming,
        ">= 0.9",
        ideal=1.0,
        median_epoch_s={"memory": round(memory, 3), "streaming": round(streaming, 3)},
        epoch_times_s={k: [round(t, 3) for t in v] for k, v in times.items()},
        model="examples/mnist_cnn.py, 4000 items, 1 group x 2 workers, batch 128",
        loader_processes_per_worker="engine default (0 here)"
        if num_workers is None
        else num_workers,
    )


def _rollup(pid: int) -> dict[str, int]:
    """``Pss_Anon``, ``Pss_Shmem``, ``Pss_File`` and ``Rss`` of ``pid`` in bytes (0 if gone)."""
    fields = {"Rss": 0, "Pss_Anon": 0, "Pss_Shmem": 0, "Pss_File": 0}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in fields:
                fields[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return fields


def _worker_pid(datasets: Path) -> int | None:
    """The rank-1 process of the run reading ``datasets`` (its POLYTRAIN_DATASETS)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "worker.engine.launch" in cmd:
            try:
                env = proc.environ()
            except psutil.Error:
                continue
            if env.get("RANK") == "1" and env.get("POLYTRAIN_DATASETS") == str(datasets):
                return int(proc.pid)
    return None


class MemorySampler(threading.Thread):
    """Samples the memory of the rank-1 process reading ``datasets`` and its children."""

    def __init__(self, datasets: Path) -> None:
        super().__init__(daemon=True)
        self.datasets = datasets
        self.stopped = threading.Event()
        self.peak = {"private": 0, "file": 0, "rank_rss": 0}
        self.samples = 0

    def run(self) -> None:
        pid = None
        while not self.stopped.is_set():
            pid = pid or _worker_pid(self.datasets)
            if pid is not None:
                try:
                    family = [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
                except psutil.Error:
                    family = []
                rolls = [_rollup(p) for p in family]
                if rolls:
                    private = sum(r["Pss_Anon"] + r["Pss_Shmem"] for r in rolls)
                    self.peak["private"] = max(self.peak["private"], private)
                    self.peak["file"] = max(self.peak["file"], sum(r["Pss_File"] for r in rolls))
                    self.peak["rank_rss"] = max(self.peak["rank_rss"], rolls[0]["Rss"])
                    self.samples += 1
            self.stopped.wait(0.2)


def peak_memory(datasets: Path, seconds: float) -> dict[str, Any]:
    """Train one worker on ``datasets/regression.npy`` for ``seconds``; its peak memory."""
    with tempfile.TemporaryDirectory(prefix="polytrain-bench-") as tmp:
        spec = RunSpec.model_validate(
            {
                "task_id": 0,
                "code": "example:memmap_regression",
                "epochs": 1000,
                "global_batch_size": 256,
                "groups": [{"name": "a", "device_type": "cpu", "workers": 1}],
                "data": {"path": "streaming", "num_workers": 1},
                "checkpoint_dir": str(Path(tmp) / "ck"),
            }
        )
        sampler = MemorySampler(datasets)
        sampler.start()
        started = time.monotonic()
        run = launch_local(
            spec,
            timeout_s=seconds,
            env_extra={"POLYTRAIN_DATASETS": str(datasets), "POLYTRAIN_NUM_THREADS": "1"},
        )
        sampler.stopped.set()
        sampler.join()
    crashed = [r for r, code in run.returncodes.items() if code not in (0, -9, -15)]
    if crashed or sampler.samples == 0:
        for rank in run.output:
            print(f"--- rank {rank}\n" + "\n".join(run.output[rank][-30:]), file=sys.stderr)
        sys.exit(1)
    data_lines = [line for line in run.output[0] if line.startswith("data:") or "data:" in line]
    return {
        "mib": {k: round(v / 2**20, 1) for k, v in sampler.peak.items()},
        "samples": sampler.samples,
        "wall_s": round(time.monotonic() - started, 1),
        "data": data_lines[:1],
    }


def worker_rss_ratio(seconds: float, keep: Path | None) -> dict[str, Any]:
    """Write the 20 MB and 2 GB arrays, train on each, emit ``worker_rss_ratio``."""
    with tempfile.TemporaryDirectory(prefix="polytrain-datasets-", dir=keep) as tmp:
        results = {}
        for label, megabytes in (("20MB", 20), ("2GB", 2048)):
            folder = Path(tmp) / label
            made = subprocess.run(
                [sys.executable, str(MAKE_DATASETS), str(folder), "--memmap-mb", str(megabytes)],
                capture_output=True,
                text=True,
                check=True,
            )
            size = (folder / "regression.npy").stat().st_size
            results[label] = {**peak_memory(folder, seconds), "file_mib": round(size / 2**20)}
            results[label]["made"] = made.stdout.strip()
            (folder / "regression.npy").unlink()
    big, small = results["2GB"]["mib"], results["20MB"]["mib"]
    return emit(
        "worker_rss_ratio",
        big["private"] / small["private"],
        "<= 1.5",
        ideal=1.0,
        rank_rss_ratio=round(big["rank_rss"] / small["rank_rss"], 3),
        runs=results,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--keep", type=Path, default=None, help="folder for the temporary files")
    parser.add_argument("--only", choices=["data_path_ratio", "worker_rss_ratio"], default=None)
    parser.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="loader processes per worker when streaming (default: the engine's, 0 here)",
    )
    parser.add_argument(
        "--also-num-workers",
        type=int,
        default=1,
        help="a second data_path_ratio line with this many loader processes (-1: none)",
    )
    args = parser.parse_args()
    if args.only in (None, "data_path_ratio"):
        data_path_ratio(args.rounds, args.num_workers)
        if args.also_num_workers >= 0:
            data_path_ratio(args.rounds, args.also_num_workers)
    if args.only in (None, "worker_rss_ratio"):
        worker_rss_ratio(args.seconds, args.keep)


if __name__ == "__main__":
    main()
