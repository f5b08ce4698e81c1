"""Benchmark ``fsdp_vs_torch_step_ratio``: the engine's step time with ``sharding: fsdp`` over
plain FSDP2's.

What a user would otherwise run is torch's FSDP2 (``torch.distributed.fsdp.fully_shard``
over the world's mesh, gloo, default settings) on the same processes. Both train
bench/workloads/deep_mlp.py (256 -> H, 7 x (H -> H), H -> 10 with ReLU) with the same data,
seed, global batch (128: 64 per worker) and Adam, one torch thread per process, no
throttling, even split, each compute process pinned to its own core of this 2-core host
(the parameter server, idle during steps, is not pinned):

- **FSDP2**: 2 ranks; each unit the engine chooses for the model is ``fully_shard``-ed,
  then the root (worker/engine/fsdp.py ``size_units``: FSDP2 has no wrapping policy of
  its own, and the same units make the same gathers); default settings otherwise
  (gradients averaged, glibc's allocator as it comes); each rank takes its half of every
  global batch of a seeded permutation.
- **FSDP2, fixed mmap threshold** (``torch_mmap``): the same with glibc's mmap threshold
  fixed at the engine's (``MALLOC_MMAP_THRESHOLD_``, 1 MiB): a sharded worker of the engine
  fixes it (worker/engine/fsdp.py ``return_freed_memory``) so that the unit gathers freed
  every step go back to the system, and then maps and faults them in again every step.
- **engine**: one group of 2 workers, ``sharding: fsdp``, sync strategy, plus the parameter
  server.

Step time of a run: its second epoch's seconds over its steps (32 an epoch at 1M parameters,
8 at 10M: an epoch of about 2 s or more; the first epoch warms up); for the engine the
parameter server's ``epoch_time_s`` (validation, the epoch-end model transfer and
checkpoint excluded), for FSDP2 the same measured around its step loop, as
bench/engine_vs_ddp.py measures both. Every round runs the three arms back to back, in
reversed order every other round (bench/stats.py); the ratio of a round is its engine step
time over its FSDP2 step time, and the line reports the median of ``--rounds`` rounds with
a 95 % bootstrap interval and every round's ratio; ``ratio_same_allocator`` is the same
over the torch_mmap arm (the engine's own cost, the allocator's taken out). Sizes: about
1M and 10M parameters. One JSON line per size (``fsdp_vs_torch_step_ratio_<size>``), then
the summary ``fsdp_vs_torch_step_ratio`` whose value is the worst median (target <= 1.10
at every size). Ideal 1.0: the engine costs what FSDP2 costs.

    python -m bench.fsdp_vs_torch [--rounds 5] [--sizes 1M,10M]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch

from bench.common import emit, ps_metric, run_task, workload
from bench.stats import paired_ratios, paired_rounds, summary
from bench.throttle import pin
from bench.workloads import deep_mlp
from worker.engine.fsdp import MMAP_THRESHOLD_BYTES, size_units
from worker.engine.launch import exit_now
from worker.engine.local import LocalRun
from worker.engine.ranks import free_port, jemalloc_path

GLOBAL_BATCH, EPOCHS = 128, 2
CORES = (0, 1)  # compute process i runs on core CORES[i]
TARGET = "<= 1.10"
# The torch_mmap arm: plain FSDP2 with glibc's mmap threshold fixed as the engine fixes it
# on a sharded worker (worker/engine/fsdp.py return_freed_memory).
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES)}


def steps_for(hidden: int) -> int:
    """Steps an epoch: enough that an epoch lasts about 2 s or more on this host."""
    return 32 if hidden <= 1000 else 8


def _env(hidden: int, batch: int, steps: int) -> dict[str, str]:
    return {
        "POLYTRAIN_BENCH_HIDDEN": str(hidden),
        "POLYTRAIN_BENCH_ITEMS": str(batch * steps),
        "POLYTRAIN_NUM_THREADS": "1",
    }


def torch_rank(rank: int, port: int, batch: int, epochs: int) -> NoReturn:
    """One plain FSDP2 rank (run as ``--torch-rank``): trains ``epochs`` epochs of global
    batches of ``batch``; rank 0 prints each epoch's seconds a step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    pin(os.getpid(), CORES[rank])
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = deep_mlp.build_model()
    for unit in size_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train, _ = deep_mlp.build_datasets()
    x, y = train.tensors
    steps = len(x) // batch
    optimizer = deep_mlp.build_optimizer(model.parameters())
    per_step = []
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        dist.barrier()
        started = time.perf_counter()
        for step in range(steps):
            part = order[step * batch : (step + 1) * batch]
            mine = part[rank * batch // 2 : (rank + 1) * batch // 2]
            optimizer.zero_grad(set_to_none=True)
            deep_mlp.loss_fn(model(x[mine]), y[mine]).backward()
            optimizer.step()
        dist.barrier()
        per_step.append((time.perf_counter() - started) / steps)
    if rank == 0:
        print(json.dumps({"step_s": per_step}), flush=True)
    # End here, with the model alive: freeing it (on return) destroys its gloo group, whose
    # destructor can wait for good on gloo's threads (bench/engine_vs_ddp.py, ddp_rank).
    exit_now(0)


def torch_step_s(
    hidden: int,
    *,
    batch: int = GLOBAL_BATCH,
    epochs: int = EPOCHS,
    steps: int | None = None,
    env: dict[str, str] | None = None,
    on_spawn: Callable[[dict[int, int]], None] | None = None,
) -> list[float]:
    """Seconds a step of plain FSDP2 on 2 gloo ranks, one value an epoch (the first one
    included), ``steps`` an epoch (default :func:`steps_for`); ``env`` is added to the
    ranks' environment, ``on_spawn`` gets each rank's process id once both have started."""
    port = free_port()
    steps = steps if steps is not None else steps_for(hidden)
    full_env = {**os.environ, **_env(hidden, batch, steps), **(env or {})}
    command = [sys.executable, "-m", "bench.fsdp_vs_torch", "--port", str(port)]
    command += ["--batch", str(batch), "--epochs", str(epochs), "--torch-rank"]
    procs = [
        subprocess.Popen([*command, str(r)], env=full_env, stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    if on_spawn is not None:
        on_spawn({r: p.pid for r, p in enumerate(procs)})
    out = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"FSDP2 run failed: {out}")
    return list(json.loads(out[0].strip().splitlines()[-1])["step_s"])


def engine_run(hidden: int, jemalloc: bool = False) -> LocalRun:
    """The engine's run of :data:`EPOCHS` epochs, one group of 2 workers with ``sharding:
    fsdp``, its sharded workers on glibc's malloc as by default or, with ``jemalloc``, on
    jemalloc (``POLYTRAIN_JEMALLOC=on``, worker/engine/ranks.py ``allocator_env``); exits 1
    if it fails (:func:`bench.common.run_task`)."""
    with _jemalloc(jemalloc):
        return _engine_run(hidden)


@contextlib.contextmanager
def _jemalloc(on: bool) -> Iterator[None]:
    """``POLYTRAIN_JEMALLOC`` of this process (the launcher reads it) set to ``on`` or ``off``
    inside, restored after."""
    before = os.environ.get("POLYTRAIN_JEMALLOC")
    os.environ["POLYTRAIN_JEMALLOC"] = "on" if on else "off"
    try:
        yield
    finally:
        if before is None:
            del os.environ["POLYTRAIN_JEMALLOC"]
        else:
            os.environ["POLYTRAIN_JEMALLOC"] = before


def _engine_run(hidden: int) -> LocalRun:
    return run_task(
        {
            "code": workload("deep_mlp"),
            "epochs": EPOCHS,
            "global_batch_size": GLOBAL_BATCH,
            "groups": [{"name": "a", "device_type": "cpu", "workers": 2}],
            "sharding": "fsdp",
        },
        timeout_s=900,
        env=_env(hidden, GLOBAL_BATCH, steps_for(hidden)),
        on_spawn=lambda pids: [pin(pids[r], CORES[r - 1]) for r in (1, 2)],
    )


def engine_step_s(run: LocalRun, steps: int) -> list[float]:
    """Seconds a step of an engine run: the parameter server's ``epoch_time_s`` over the
    epoch's steps, epochs after the first."""
    return [t / steps for t in ps_metric(run, "epoch_time_s")[1:]]


def jemalloc_figures(times: dict[str, list[float]]) -> dict[str, Any]:
    """The engine on jemalloc against plain FSDP2 (``ratio_jemalloc``, median and 95 %
    interval), where the host has jemalloc and the arm ran; else nothing."""
    if "engine_jemalloc" not in times:
        return {}
    ratio = summary(paired_ratios(times["engine_jemalloc"], times["torch"]))
    return {"ratio_jemalloc": ratio["median"], "ci95_jemalloc": ratio["ci95"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--sizes", default="1M,10M", help=f"of {list(deep_mlp.WIDTHS)}, or hidden widths"
    )
    parser.add_argument("--torch-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=GLOBAL_BATCH, help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=EPOCHS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_rank is not None:
        torch_rank(args.torch_rank, args.port, args.batch, args.epochs)  # ends the process
    worst = 0.0
    for size in args.sizes.split(","):
        hidden = deep_mlp.width(size)
        steps = steps_for(hidden)
        arms = {
            "torch": lambda h=hidden: statistics.median(torch_step_s(h)[1:]),
            "torch_mmap": lambda h=hidden: statistics.median(torch_step_s(h, env=MMAP_ENV)[1:]),
            "engine": lambda h=hidden, s=steps: statistics.median(engine_step_s(engine_run(h), s)),
        }
        if jemalloc_path({"POLYTRAIN_JEMALLOC": "on"}) is not None:
            arms["engine_jemalloc"] = lambda h=hidden, s=steps: statistics.median(
                engine_step_s(engine_run(h, jemalloc=True), s)
            )
        times = paired_rounds(arms, args.rounds)
        ratio = summary(paired_ratios(times["engine"], times["torch"]))
        same = summary(paired_ratios(times["engine"], times["torch_mmap"]))
        worst = max(worst, ratio["median"])
        emit(
            f"fsdp_vs_torch_step_ratio_{deep_mlp.label(size)}",
            ratio["median"],
            TARGET,
            ideal=1.0,
            parameters=deep_mlp.parameters(hidden),
            ci95=ratio["ci95"],
            rounds=args.rounds,
            ratios=ratio["values"],
            ratio_same_allocator=same["median"],
            ci95_same_allocator=same["ci95"],
            **jemalloc_figures(times),
            steps_per_epoch=steps,
            median_step_ms={k: round(statistics.median(v) * 1000, 2) for k, v in times.items()},
            step_ms={k: [round(t * 1000, 2) for t in v] for k, v in times.items()},
        )
    emit(
        "fsdp_vs_torch_step_ratio",
        worst,
        TARGET,
        ideal=1.0,
        sizes=[deep_mlp.label(size) for size in args.sizes.split(",")],
        global_batch=GLOBAL_BATCH,
        workers=2,
        optimizer="Adam",
        mmap_threshold=MMAP_THRESHOLD_BYTES,
    )


if __name__ == "__main__":
    main()
