"""Benchmark ``speed_noise``: how far the optimal split of ``rebalance_tracking`` moves by itself
on this host, with no change of quota and no engine.

``rebalance_tracking`` asks the balancer to hold the slow group's share within 5 % of the
optimum ``r_slow / (r_fast + r_slow)``. That is only possible where the optimum itself
holds still to within 5 % at the scale the balancer measures (a window of 4 steps, about a
third of a second there). Here two plain PyTorch loops of the same model (bench/workloads/
hetero_cnn.py, one torch thread each) run side by side, placed as the benchmark places the
groups (bench/throttle.py): "fast" on core 0 with no quota and ``--fast-batch`` samples a
step, "slow" on core 1 at ``--slow-fraction`` of it and ``--slow-batch`` samples, fixed,
for ``--seconds``. Each step's samples are spread evenly over its duration, the timeline
is cut into bins (0.35 s: about a 4-step window of the tracking task; 1.4 s: about its
16-step epoch), and each bin gives both rates and so an optimal slow share. This is the
noise of the host as it is (a shared machine: other processes may run on either core).

Reported per bin length: the coefficient of variation of each rate and of the optimal
share, and ``within_5pct``: the fraction of bins whose optimal share (the split that
would have equalised that bin's steps) is within 5 % of the whole run's. ``value`` is
``within_5pct`` at 0.35 s. No target: it is how much the quantity that
``rebalance_tracking`` asks the balancer to hit within 5 % moves by itself at the scale of
the balancer's measurements. Needs root and the cgroup v1 cpu controller; exits 2 where
it is missing.

    python -m bench.speed_noise [--seconds 30] [--slow-fraction 0.3333]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from bench.common import emit, run_processes, workload
from bench.neighbour import plain_step, plain_training
from bench.throttle import PERIOD_US, CpuGroup, Throttle, ThrottleError, exit_unavailable

PREFIX = "ptbench-noise"
BINS_S = (0.35, 1.4)
SETTLED = 0.05
WARMUP_S = 1.0

Steps = list[tuple[float, float]]


def _loop(name: str, group: CpuGroup, batch: int, seconds: float, out: Any) -> None:
    """Train hetero_cnn on ``batch`` samples a step in ``group`` for ``seconds`` (a child
    process); put ``(name, [(start, end), ...])`` (perf_counter seconds of each step)."""
    import torch

    code, inputs, targets, model, optimizer = plain_training(workload("hetero_cnn"))
    group.place(os.getpid())
    steps: Steps = []
    stop = time.perf_counter() + seconds
    while (start := time.perf_counter()) < stop:
        idx = torch.arange(len(steps) * batch, (len(steps) + 1) * batch) % len(inputs)
        plain_step(code, model, optimizer, inputs, targets, idx)
        steps.append((start, time.perf_counter()))
    out.put((name, steps))


def binned_rates(steps: Steps, batch: int, edges: list[float]) -> list[float]:
    """Samples/s in each bin ``[edges[i], edges[i+1])``, each step's samples spread evenly
    over its duration."""
    rates = []
    for low, high in zip(edges, edges[1:], strict=False):
        done = sum(
            batch * max(0.0, min(end, high) - max(start, low)) / (end - start)
            for start, end in steps
            if end > low and start < high and end > start
        )
        rates.append(done / (high - low))
    return rates


def cv(values: list[float]) -> float:
    """Coefficient of variation (sample standard deviation over the mean)."""
    return statistics.stdev(values) / statistics.fmean(values)


def share_noise(fast: Steps, slow: Steps, batches: tuple[int, int], width: float) -> dict[str, Any]:
    """The rates of both loops and the optimal slow share ``r_slow / (r_fast + r_slow)`` in
    bins of ``width`` seconds over the time both ran (after each one's first WARMUP_S):
    their coefficients of variation, the whole run's optimal share and the fraction of
    bins within SETTLED of it. Raises ValueError when fewer than two bins fit."""
    begin = max(fast[0][0], slow[0][0]) + WARMUP_S
    end = min(fast[-1][1], slow[-1][1])
    count = int((end - begin) / width)
    if count < 2:
        raise ValueError(f"the loops ran together for {end - begin:.2f} s: under two bins")
    edges = [begin + i * width for i in range(count + 1)]
    r_fast, r_slow = binned_rates(fast, batches[0], edges), binned_rates(slow, batches[1], edges)
    share = [s / (f + s) for f, s in zip(r_fast, r_slow, strict=True)]
    whole = sum(r_slow) / (sum(r_fast) + sum(r_slow))
    return {
        "bins": count,
        "cv_fast": round(cv(r_fast), 4),
        "cv_slow": round(cv(r_slow), 4),
        "cv_optimal_share": round(cv(share), 4),
        "within_5pct": round(sum(abs(x / whole - 1) <= SETTLED for x in share) / count, 4),
        "optimal_share": round(whole, 4),
        "share_range": [round(min(share), 4), round(max(share), 4)],
        "samples_per_s": [round(statistics.fmean(r_fast), 1), round(statistics.fmean(r_slow), 1)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="the host's speed noise at the balancer's scale")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--slow-fraction", type=float, default=1 / 3)
    parser.add_argument("--fast-batch", type=int, default=200)
    parser.add_argument("--slow-batch", type=int, default=56)
    parser.add_argument("--period-us", type=int, default=PERIOD_US, help="CFS period (µs)")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    try:
        with Throttle(prefix=PREFIX, period_us=args.period_us) as throttle:
            cpu = throttle.fast_and_slow(args.slow_fraction)
            found = dict(
                run_processes(
                    [
                        (_loop, ("fast", cpu["fast"], args.fast_batch, args.seconds)),
                        (_loop, ("slow", cpu["slow"], args.slow_batch, args.seconds)),
                    ],
                    timeout_s=args.seconds + 300,
                )
            )
    except ThrottleError as err:
        exit_unavailable(err, "bench.speed_noise")
    batches = (args.fast_batch, args.slow_batch)
    bins = {f"{w}s": share_noise(found["fast"], found["slow"], batches, w) for w in BINS_S}
    emit(
        "speed_noise",
        bins[f"{BINS_S[0]}s"]["within_5pct"],
        "none (the noise floor under rebalance_tracking's 5 % criterion)",
        bins=bins,
        batches=list(batches),
        seconds=args.seconds,
        slow_fraction=round(args.slow_fraction, 4),
        period_us=args.period_us,
        load_avg_1min=[round(load, 2), round(os.getloadavg()[0], 2)],
    )


if __name__ == "__main__":
    main()
