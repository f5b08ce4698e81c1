"""Benchmarks ``hetero_efficiency`` and ``hetero_efficiency_periodic``: throughput of two
heterogeneous groups trained together over the sum of their standalone throughputs.

Two groups of one worker, both emulated (worker.engine.emulation): "fast"
at 1/2 and "slow" at 1/6 of this CPU's speed, so the slow group has 1/3 of
the fast one's throughput and each worker keeps a core busy at most half of
the time: on a shared two-core host each group then has the compute it would
have on hardware of its own, which is what "standalone" assumes. Each group
trains the task alone, with its own parameter server and the whole global
batch: its standalone samples/s. Then both train
it together with the weighted split. ``hetero_efficiency`` (target >= 0.92)
syncs every step, alone and together; ``hetero_efficiency_periodic`` (target
>= 0.95) averages models every 8 steps, alone (one group: local steps, a
parameter-server round every 8 steps) and together. Throughput
is training samples over the median epoch seconds (``epoch_time_s`` of the
parameter server, validation excluded) of ``--rounds`` rounds of
``--epochs`` epochs (the first epoch of every run, which warms up kernels
for new batch shapes and lets the balancer settle, is left out alike for
every configuration). The six configurations run in one order in even rounds
and in the reverse order in odd ones (A B C C B A: counterbalanced), so a
drift of the host's speed during the run, which on this shared host reaches
a third within minutes, touches every configuration alike rather than
favouring the ones that ran first.
Workload: bench/workloads/hetero_cnn.py, global batch 256. At most two busy
processes: one worker alone (+ its waiting parameter server), or two workers
(+ the parameter server) together.

    python -m bench.hetero_efficiency [--epochs 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench.common import emit, ps_metric, run_task, workload

# Both groups are emulated (fast at 1/2, slow at 1/6 of this CPU: 3 to 1), so each worker
# keeps its core busy at most half of the time and two workers need at most one core:
# on a shared two-core host, each group then has the compute it would have on its own.
FAST, SLOW = 1 / 2, 1 / 6
N_TRAIN = 4096
GROUPS = [
    {"name": "fast", "device_type": "cpu", "workers": 1, "speed_factor": FAST},
    {"name": "slow", "device_type": "cpu", "workers": 1, "speed_factor": SLOW},
]


def epoch_times(groups: list[dict[str, Any]], epochs: int, **options: Any) -> list[float]:
    """Per-epoch training seconds of one run of the task on ``groups``."""
    run = run_task(
        {
            "code": workload("hetero_cnn"),
            "epochs": epochs,
            "global_batch_size": 256,
            "groups": groups,
            "rebalance_every": 4,
            **options,
        }
    )
    return ps_metric(run, "epoch_time_s")[1:]  # epoch 0 warms up: reported, not counted


PERIODIC = {"sync_strategy": "periodic", "sync_period": 8}
CONFIGS: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "fast alone, sync": ([GROUPS[0]], {}),
    "slow alone, sync": ([GROUPS[1]], {}),
    "together, sync": (GROUPS, {"split_policy": "weighted"}),
    "fast alone, periodic": ([GROUPS[0]], PERIODIC),
    "slow alone, periodic": ([GROUPS[1]], PERIODIC),
    "together, periodic": (GROUPS, {"split_policy": "weighted", **PERIODIC}),
}


def report(name: str, strategy: str, target: str, rate: dict[str, float], **raw: Any) -> None:
    """One result line: together over fast alone + slow alone, for ``strategy``."""
    alone = [rate[f"fast alone, {strategy}"], rate[f"slow alone, {strategy}"]]
    together = rate[f"together, {strategy}"]
    emit(
        name,
        together / sum(alone),
        target,
        together_samples_per_s=round(together, 1),
        standalone_samples_per_s=[round(a, 1) for a in alone],
        sum_standalone=round(sum(alone), 1),
        **raw,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="heterogeneous throughput efficiency")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="even: counterbalanced")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    order = list(CONFIGS.items())
    for round_ in range(args.rounds):
        for name, (groups, options) in order if round_ % 2 == 0 else order[::-1]:
            times[name] += epoch_times(groups, args.epochs, **options)
    rate = {name: N_TRAIN / statistics.median(t) for name, t in times.items()}
    raw = {
        "speed_factors": [FAST, round(SLOW, 4)],
        "epochs": args.epochs,
        "rounds": args.rounds,
        "global_batch": 256,
    }
    for strategy, name, target, label in (
        ("sync", "hetero_efficiency", ">= 0.92", "every step"),
        ("periodic", "hetero_efficiency_periodic", ">= 0.95", "periodic, every 8 steps"),
    ):
        epoch_s = {k: [round(x, 3) for x in v] for k, v in times.items() if k.endswith(strategy)}
        report(name, strategy, target, rate, sync=label, epoch_s=epoch_s, **raw)


if __name__ == "__main__":
    main()
