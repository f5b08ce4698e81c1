"""Benchmark ``hetero_bound``: the most a throttled group can add to a fast one, measured with
plain PyTorch (not the engine), to read ``hetero_gain_real`` (bench/hetero_real.py) against.

``hetero_gain_real``'s ideal, ``1 + r_slow / r_fast``, assumes the slow group's samples cost
it only their compute. A step of data-parallel training also has costs that do not shrink
with the samples a device takes: its backward writes the whole gradient, its optimizer step
updates every parameter, and each exchange copies the whole gradient or model through the
sockets, all of it CPU time of the slow process at its quota (bench/throttle.py). This
benchmark measures those costs with plain PyTorch, two processes placed as
``bench.hetero_real`` places the engine's groups ("fast" on core 0 with no quota, "slow" on
core 1 at ``--slow-fraction`` of it; one torch thread each), on the models and global
batches B of ``bench.hetero_real``. Per round (paired, counterbalanced, ``bench.stats``),
each arm the mean seconds of ``STEPS`` steps after ``WARMUP`` (the mean: throughput is total
time over steps, and steps shorter than a CFS period are bimodal under a quota):

- ``fast_alone``: one process on the fast core, steps of B samples (forward, backward,
  ``optimizer.step``); ``slow_alone``: the same on the slow core. ``r_slow / r_fast`` is
  ``fast_alone / slow_alone``.
- ``slow_floor``: the slow core, 1 sample a step: a local step of the slow group with the
  least share it can have (periodic's steps between exchanges).
- ``sync_floor``: ``DistributedDataParallel`` (gloo, ``gradient_as_bucket_view``) across the
  two, 1 sample on each rank, from a barrier to the end of the slower rank's step: what
  DDP takes for a synchronous step with the slow group in it at its least share (the
  gradient's allreduce is copied through loopback sockets on the slow rank's throttled CPU).
- ``exchange``: one ``all_reduce`` of the model's parameters (gloo) between the two, from a
  barrier to the slower rank's end: periodic's model average as a ring (the engine's
  periodic goes through its parameter server, which costs more: docs/benchmarks.md).

The estimate. With ``b`` of the B samples on the slow group, each sample past the first
costs it ``p = (slow_alone - slow_floor) / (B - 1)`` (a straight line through the two
measured points), and the fast group's step is taken as ``fast_alone (B - b) / B`` (its
own fixed costs left out):

- ``sync``: a step lasts ``max(fast_alone (B - b) / B, sync_floor + (b - 1) p)``;
- ``periodic`` (H = 8, every group takes every step, as the engine's does): a step lasts
  ``max(fast_alone (B - b) / B, slow_floor + (b - 1) p + exchange / H)``;

the best ``b`` in 1..B, or the fast group alone (gain 1), gives together ÷ fast alone;
divided by the ideal of the same round it is the **ceiling** this host puts on
``hetero_gain_real`` for such an engine. A model, not a proof: the line through 1 and B
samples is not exact (under a quota a 1-sample step may fit in one period's quota), and
an engine that stepped the slow group's optimizer elsewhere would have other costs.

One line per size (``hetero_bound_34k``, ``hetero_bound_10M``) with the millisecond
figures and the slow group's throttled fraction of CFS periods, then ``hetero_bound``
whose value is the lowest ceiling. Needs root and the cgroup v1 cpu controller; exits 2
where it is missing.

    python -m bench.hetero_bound [--rounds 5] [--sizes 34k,10M] [--slow-fraction 0.3333]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.common import emit, run_processes
from bench.hetero_real import MODELS, throttled_fraction
from bench.neighbour import plain_step, plain_training
from bench.stats import paired_ratios, paired_rounds, summary
from bench.throttle import PERIOD_US, CpuGroup, Throttle, ThrottleError, exit_unavailable
from worker.engine.ranks import free_port

PREFIX = "ptbench-bound"
WARMUP, STEPS, PERIOD = 3, 12, 8
TARGET = "ceiling on hetero_gain_real (that benchmark's target: >= 0.95)"


def _rank(  # runs in a child process
    size: str, group: CpuGroup, batch: int, mode: str, rank: int, port: int, out: Any
) -> None:
    """One process of an arm: set up, move into ``group``, time STEPS steps of ``batch``
    samples (``mode`` "local": plain steps; "ddp": DDP steps with 2 ranks; "exchange": an
    all_reduce of the parameters); put ``(rank, mean seconds a step)`` on ``out``."""
    import torch
    import torch.distributed as dist

    os.environ.update(MODELS[size].env)
    code, inputs, targets, model, optimizer = plain_training(MODELS[size].code)
    if mode != "local":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        if mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    vector = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    group.place(os.getpid())
    seconds: list[float] = []
    for step in range(WARMUP + STEPS):
        if mode != "local":
            dist.barrier()  # both start together; each times to the end of its own part
        start = time.perf_counter()
        if mode == "exchange":
            dist.all_reduce(vector)
        else:
            idx = torch.arange(step * batch, (step + 1) * batch) % len(inputs)
            plain_step(code, model, optimizer, inputs, targets, idx)
        seconds.append(time.perf_counter() - start)
    if mode != "local":
        dist.barrier()  # neither rank tears down its connections while the other uses them
        dist.destroy_process_group()
    out.put((rank, statistics.fmean(seconds[WARMUP:])))


def arm(size: str, cpu: dict[str, CpuGroup], plan: list[tuple[str, int]], mode: str) -> float:
    """Seconds a step of one arm: ``plan`` is (group name, batch) per rank; the slower
    rank's mean."""
    port = free_port()
    targets = [
        (_rank, (size, cpu[name], batch, mode, rank, port))
        for rank, (name, batch) in enumerate(plan)
    ]
    return max(seconds for _, seconds in run_processes(targets, timeout_s=600))


def arms(size: str, cpu: dict[str, CpuGroup]) -> dict[str, Callable[[], float]]:
    batch = MODELS[size].batch
    return {
        "fast_alone": lambda: arm(size, cpu, [("fast", batch)], "local"),
        "slow_alone": lambda: arm(size, cpu, [("slow", batch)], "local"),
        "slow_floor": lambda: arm(size, cpu, [("slow", 1)], "local"),
        "sync_floor": lambda: arm(size, cpu, [("fast", 1), ("slow", 1)], "ddp"),
        "exchange": lambda: arm(size, cpu, [("fast", batch), ("slow", batch)], "exchange"),
    }


def best_gain(fast_step: float, batch: int, slow_cost: Callable[[int], float]) -> float:
    """The most samples/s together ÷ fast alone over the slow group's share ``b`` in 1..B:
    a step lasts ``max(fast_step (B - b) / B, slow_cost(b))``; the fast group alone
    (gain 1) is always possible."""
    steps = (max(fast_step * (batch - b) / batch, slow_cost(b)) for b in range(1, batch + 1))
    return max(1.0, fast_step / min(steps))


def bounds(runs: dict[str, list[float]], batch: int) -> dict[str, list[float]]:
    """Per round: r_slow / r_fast, the ideal gain, and the sync and periodic ceilings."""
    out: dict[str, list[float]] = {"ratio": [], "ideal": [], "sync": [], "periodic": []}
    for i, fast in enumerate(runs["fast_alone"]):
        slow, floor = runs["slow_alone"][i], runs["slow_floor"][i]
        sync_floor, exchange = runs["sync_floor"][i], runs["exchange"][i]
        ideal = 1 + fast / slow
        per_sample = max(slow - floor, 0.0) / (batch - 1)
        out["ratio"].append(fast / slow)
        out["ideal"].append(ideal)
        sync = best_gain(fast, batch, lambda b: sync_floor + (b - 1) * per_sample)  # noqa: B023
        periodic = best_gain(  # per step: the period's exchange over H
            fast,
            batch,
            lambda b: floor + (b - 1) * per_sample + exchange / PERIOD,  # noqa: B023
        )
        out["sync"].append(sync / ideal)
        out["periodic"].append(periodic / ideal)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="ceilings on hetero_gain_real on this host")
    parser.add_argument("--rounds", type=int, default=5, help="paired, counterbalanced")
    parser.add_argument("--sizes", default="34k,10M", help=f"of {','.join(MODELS)}")
    parser.add_argument("--slow-fraction", type=float, default=1 / 3)
    parser.add_argument("--period-us", type=int, default=PERIOD_US, help="CFS period (µs)")
    args = parser.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    if not sizes or set(sizes) - set(MODELS):
        parser.error(f"--sizes: one or more of {sorted(MODELS)}, got {args.sizes!r}")
    lowest: list[float] = []
    try:
        with Throttle(prefix=PREFIX, period_us=args.period_us) as throttle:
            cpu = throttle.fast_and_slow(args.slow_fraction)
            for size in sizes:
                load, before = os.getloadavg()[0], cpu["slow"].stat()
                runs = paired_rounds(arms(size, cpu), args.rounds)
                found = bounds(runs, MODELS[size].batch)
                worst = min(summary(found["sync"])["median"], summary(found["periodic"])["median"])
                lowest.append(worst)
                emit(
                    f"hetero_bound_{size}",
                    worst,
                    TARGET,
                    sync_ceiling=summary(found["sync"]),
                    periodic_ceiling=summary(found["periodic"]),
                    r_slow_over_r_fast=summary(found["ratio"]),
                    ideal_gain=summary(found["ideal"]),
                    ms={k: summary([1000 * s for s in v], 2) for k, v in runs.items()},
                    samples_per_s={
                        "fast": round(
                            MODELS[size].batch / statistics.median(runs["fast_alone"]), 1
                        ),
                        "slow": round(
                            MODELS[size].batch / statistics.median(runs["slow_alone"]), 1
                        ),
                    },
                    sync_floor_over_fast_alone=summary(
                        paired_ratios(runs["sync_floor"], runs["fast_alone"])
                    ),
                    slow_periods_throttled=throttled_fraction(cpu["slow"], before),
                    global_batch=MODELS[size].batch,
                    periodic_h=PERIOD,
                    slow_fraction=round(args.slow_fraction, 4),
                    period_us=args.period_us,
                    rounds=args.rounds,
                    load_avg_1min=[round(load, 2), round(os.getloadavg()[0], 2)],
                )
    except ThrottleError as err:
        exit_unavailable(err, "bench.hetero_bound")
    emit("hetero_bound", min(lowest), TARGET, sizes=sizes)


if __name__ == "__main__":
    main()
