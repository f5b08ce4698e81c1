"""Benchmark ``weighted_vs_even_speedup``: epoch time with an even split over epoch time
with a weighted split, two groups of one worker each, the second at 1/3 speed.

EMULATED SPEED: both groups' speeds come from sleep padding (worker.engine.emulation), not
from real, reduced compute (see bench.hetero_real and bench.rebalance_tracking for real
CPU throttling); the ratio measures the split under perfectly steady emulated devices.

Both groups are emulated (worker.engine.emulation): "fast" at 1/2 and "slow"
at 1/6 of this CPU's speed, so the slow group has 1/3 of the fast one's speed
and each worker keeps a core busy at most half of the time. (With the fast
group unemulated, its worker kept a core busy all the time and its step time
carried every disturbance of this shared two-core host and the slow worker's
compute beside it; the slow one's did not.) With an even split every step waits for the slow
worker's half batch (3 x B/2 = 1.5 B units of time); with shares proportional
to throughput the fast worker takes 3/4 of the batch and both finish at
0.75 B, so the ideal ratio is 2.0. Both splits run the same synchronous task
(bench/workloads/hetero_cnn.py, global batch 512, 8 steps per epoch),
alternating, ``--rounds`` times each; the value is the ratio of the median
epoch times (``epoch_time_s`` reported by the parameter server, which
excludes validation) after the first epoch of each run, which warms up
kernels for new batch shapes and lets the balancer settle (left out for both
splits). Target >= 1.85. Processes: the parameter server
(mostly waiting) and two workers. The emulated speed of both groups is fixed
for the whole benchmark from one calibration (``bench.common.calibrated_pace``,
as in bench.hetero_efficiency); ``--pace recent`` paces each worker by its own
fastest recent sections instead. With the pace's line ``a + c * b`` the ideal
stays 2.0 whatever its fixed part ``a``: the balanced slow share becomes
``B/4 - a/(2c)`` and its step ``3 (a + c B/2)``, half the even step
``6 (a + c B/2)`` (``a`` below 0, which this host's calibrations give, only
gives the slow worker more than a quarter of the batch).

    python -m bench.weighted_vs_even [--rounds 2] [--epochs 3] [--pace fixed|recent]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench.common import (
    add_pace_option,
    emit,
    idle_fractions,
    pace_option,
    ps_metric,
    run_task,
    workload,
)

FAST, SLOW = 1 / 2, 1 / 6
# Per-worker batches: 256 even, about 384 and 128 weighted, 256 profiling.
PACE_SIZES = [64, 96, 128, 160, 192, 256, 320, 384, 448]


def spec_fields(split_policy: str, epochs: int, pace: Any = None) -> dict[str, Any]:
    """The task: two one-worker groups, the second at 1/3 of the first one's speed."""
    return {
        "emulation_pace": pace,
        "code": workload("hetero_cnn"),
        "epochs": epochs,
        "global_batch_size": 512,
        "split_policy": split_policy,
        "rebalance_every": 4,
        "groups": [
            {"name": "fast", "device_type": "cpu", "workers": 1, "speed_factor": FAST},
            {"name": "slow", "device_type": "cpu", "workers": 1, "speed_factor": SLOW},
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="weighted vs even split, one group at 1/3 speed")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    add_pace_option(parser)
    args = parser.parse_args()
    pace = pace_option(args, "hetero_cnn", PACE_SIZES)
    times: dict[str, list[float]] = {"even": [], "weighted": []}
    shares: list[float] = []
    idle: dict[str, list[list[float]]] = {}
    for _ in range(args.rounds):
        for policy in ("even", "weighted"):
            run = run_task(spec_fields(policy, args.epochs, pace))
            times[policy] += ps_metric(run, "epoch_time_s")[1:]  # epoch 0 warms up
            idle[policy] = idle_fractions(run, range(1, 3))  # the last round's
            if policy == "weighted":
                shares = [v for v in run.metrics("batch_share", rank=2) if v is not None]
    even, weighted = statistics.median(times["even"]), statistics.median(times["weighted"])
    emit(
        "weighted_vs_even_speedup",
        even / weighted,
        ">= 1.85 (ideal 2.0)",
        even_epoch_s=round(even, 4),
        weighted_epoch_s=round(weighted, 4),
        even_epochs_s=[round(t, 3) for t in times["even"]],
        weighted_epochs_s=[round(t, 3) for t in times["weighted"]],
        slow_worker_share=[round(s, 4) for s in shares],
        ideal_slow_share=0.25,
        idle_fraction_last_round=idle,
        speed="emulated (sleep padding), not throttled",
        speed_factors=[FAST, round(SLOW, 4)],
        global_batch=512,
        processes=3,
        emulation_pace=pace or "each worker's fastest recent sections",
    )


if __name__ == "__main__":
    main()
