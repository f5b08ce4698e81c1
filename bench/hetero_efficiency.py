"""Benchmarks ``hetero_efficiency`` and ``hetero_efficiency_periodic``: throughput of two
heterogeneous groups trained together over the sum of their standalone throughputs.

EMULATED SPEED: the groups' speeds come from sleep padding (worker.engine.emulation), not
from real, reduced compute, so co-running contention vanishes into the padding's slack
and communication is not slowed; what this measures is the engine's coupling overhead
between perfectly steady devices. The measurement with real throttling (CPU cgroups) is
bench.hetero_real (``hetero_gain_real``, ``hetero_efficiency_real``).

Two groups of one worker, both emulated (worker.engine.emulation): "fast"
at 1/2 and "slow" at 1/6 of this CPU's speed, so the slow group has 1/3 of
the fast one's throughput and each worker keeps a core busy at most half of
the time: on a shared two-core host each group then has the compute it would
have on hardware of its own, which is what "standalone" assumes.

Standalone: each group trains the task as a task of its own (its own
parameter server, the whole global batch); the two standalone tasks run at
the same time, so the sum of their throughputs is measured under the same
host conditions as the run together (two emulated workers sharing the host),
and at the same moment (this shared host's speed drifts by up to a third
within minutes). The fast task runs 3 times the epochs of the slow one, so
both span about the same time. Together: both groups train one task with the
weighted split. ``hetero_efficiency`` (target >= 0.92) syncs every step,
alone and together; ``hetero_efficiency_periodic`` (target >= 0.95) averages
models every 8 steps, alone (one group: local steps, a parameter-server
round every 8 steps) and together. Throughput is training samples over the
median epoch seconds (``epoch_time_s`` of the parameter server, validation
excluded) over ``--rounds`` rounds; the first epoch of every run, which warms
up kernels for new batch shapes and lets the balancer settle, is left out
alike for every configuration. The four runs of a round (alone and together,
for each strategy) go in one order in even rounds and in the reverse order in
odd ones (A B C D D C B A: counterbalanced), so a drift of the host's speed
touches every configuration alike. Workload: bench/workloads/hetero_cnn.py,
global batch 256. At most two busy processes: the two workers, alone or
together (the parameter servers mostly wait).

Emulated speed: before the first run this host's undisturbed time of a
compute section is measured once for every batch size the runs use
(``bench.common.calibrated_pace``), and every run gets it as
``emulation_pace``: each emulated group computes at one fixed speed for the
whole benchmark, as a device of its own would, so a slow spell of the shared
host no longer changes the emulated speed of whichever runs happen to meet
it. The ratio then measures what the engine adds by coupling the groups
(waits at sync points, parameter-server rounds, the split, smaller per-worker
batches). ``--pace recent`` keeps the emulation's default (each worker paced
by its own fastest recent sections) for comparison.

    python -m bench.hetero_efficiency [--epochs 4] [--rounds 4] [--pace fixed|recent]
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ThreadPoolExecutor
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

# Both groups are emulated (fast at 1/2, slow at 1/6 of this CPU: 3 to 1), so each worker
# keeps its core busy at most half of the time and two workers need at most one core:
# on a shared two-core host, each group then has the compute it would have on its own.
FAST, SLOW = 1 / 2, 1 / 6
N_TRAIN = 4096
GROUPS = [
    {"name": "fast", "device_type": "cpu", "workers": 1, "speed_factor": FAST},
    {"name": "slow", "device_type": "cpu", "workers": 1, "speed_factor": SLOW},
]
PERIODIC = {"sync_strategy": "periodic", "sync_period": 8}
# Every per-worker batch the runs use: 256 alone, about 192 and 64 together, 128 profiling.
PACE_SIZES = [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
STRATEGIES = {"sync": {}, "periodic": PERIODIC}


def epoch_times(
    groups: list[dict[str, Any]], epochs: int, **options: Any
) -> tuple[list[float], list[list[float]]]:
    """Per-epoch training seconds of one run of the task on ``groups``, and each worker's
    ``idle_fraction`` per epoch (both without epoch 0, which warms up: reported, not counted)."""
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
    return ps_metric(run, "epoch_time_s")[1:], idle_fractions(run, range(1, len(groups) + 1))


def standalone(epochs: int, options: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Epoch seconds of the fast and the slow group, each a task of its own, run side by side
    (the fast one for ``round(FAST / SLOW)`` times the epochs, so both span about as long)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        fast = pool.submit(epoch_times, [GROUPS[0]], epochs * round(FAST / SLOW), **options)
        slow = pool.submit(epoch_times, [GROUPS[1]], epochs, **options)
        return fast.result()[0], slow.result()[0]


def report(
    name: str,
    strategy: str,
    target: str,
    times: dict[str, list[float]],
    idle: dict[str, list[list[float]]],
    **raw: Any,
) -> None:
    """One result line: together over fast alone + slow alone, for ``strategy``."""
    mine = {k: v for k, v in times.items() if k.endswith(strategy)}
    rate = {k: N_TRAIN / statistics.median(v) for k, v in mine.items()}
    alone = [rate[f"fast alone, {strategy}"], rate[f"slow alone, {strategy}"]]
    together = rate[f"together, {strategy}"]
    epoch_s = {k: [round(x, 3) for x in v] for k, v in mine.items()}
    emit(
        name,
        together / sum(alone),
        target,
        together_samples_per_s=round(together, 1),
        standalone_samples_per_s=[round(a, 1) for a in alone],
        sum_standalone=round(sum(alone), 1),
        epoch_s=epoch_s,
        together_idle_fraction=idle[strategy],
        **raw,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="heterogeneous throughput efficiency")
    parser.add_argument("--epochs", type=int, default=4, help="per run (the slow group's)")
    parser.add_argument("--rounds", type=int, default=4, help="even: counterbalanced")
    add_pace_option(parser)
    args = parser.parse_args()
    pace = pace_option(args, "hetero_cnn", PACE_SIZES)
    times: dict[str, list[float]] = {
        f"{who}, {strategy}": []
        for strategy in STRATEGIES
        for who in ("fast alone", "slow alone", "together")
    }
    idle: dict[str, list[list[float]]] = {strategy: [[], []] for strategy in STRATEGIES}
    runs = [(strategy, together) for strategy in STRATEGIES for together in (False, True)]
    for round_ in range(args.rounds):
        for strategy, together in runs if round_ % 2 == 0 else runs[::-1]:
            options = {**STRATEGIES[strategy], "emulation_pace": pace}
            if together:
                seconds, idle_by_worker = epoch_times(
                    GROUPS, args.epochs, split_policy="weighted", **options
                )
                times[f"together, {strategy}"] += seconds
                for mine, more in zip(idle[strategy], idle_by_worker, strict=True):
                    mine += more
            else:
                fast, slow = standalone(args.epochs, options)
                times[f"fast alone, {strategy}"] += fast
                times[f"slow alone, {strategy}"] += slow
    raw = {
        "speed": "emulated (sleep padding), not throttled",
        "speed_factors": [FAST, round(SLOW, 4)],
        "epochs": args.epochs,
        "rounds": args.rounds,
        "global_batch": 256,
        "standalone": "both groups' tasks side by side",
        "emulation_pace": pace or "each worker's fastest recent sections",
    }
    for strategy, name, target, label in (
        ("sync", "hetero_efficiency", ">= 0.92", "every step"),
        ("periodic", "hetero_efficiency_periodic", ">= 0.95", "periodic, every 8 steps"),
    ):
        report(name, strategy, target, times, idle, sync=label, **raw)


if __name__ == "__main__":
    main()
