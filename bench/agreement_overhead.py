"""Benchmark ``agreement_overhead``: what the cross-device agreement checks cost a clean run.

The checks (:mod:`worker.engine.agreement`): before training, every group's gradient of one
fixed batch against the parameter server's; every ``agreement_every`` steps (default 100) a
parameter checksum of every group leader against the reference. The run: the engine on
bench/workloads/sized_mlp.py (about 1M and 10M parameters), two groups of one CPU worker each
(sync strategy, global batch 128, 128 steps an epoch, 3 epochs: the check before training and
3 parameter checks), one torch thread per process, each compute process pinned to its own
core. Two arms, run back to back in every round, the order reversed every other round
(bench/stats.py): **on** (the defaults: ``on_disagreement: fail``, ``agreement_every: 100``)
and **off** (``on_disagreement: off``).

- value (per size ``agreement_overhead_<size>``, and the worst as ``agreement_overhead``):
  the checks' own wall seconds, measured inside the run (the parameter server's
  ``agreement_check_s`` metric: the check before training and every parameter check), over
  the run's training seconds (its epochs' ``epoch_time_s``), median of the rounds with a 95 %
  bootstrap interval. Ideal 0.0; target <= 0.01 (the issue's "under 1 % overhead").
- cross-check: the paired ratio of the two arms' training seconds (on / off; the parameter
  checks are inside the epochs, the check before training is not) with its interval: noise
  of a few per cent between runs on this host hides a 1 % effect, which is why the value is
  the direct measurement.
- ``alarms``: alarm events the clean runs raised (must be 0: CPU groups against the CPU
  parameter server agree bit for bit).

    python -m bench.agreement_overhead [--rounds 5] [--sizes 880,3030]
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.common import emit, run_task, workload
from bench.stats import paired_ratios, paired_rounds, summary
from bench.throttle import pin

GLOBAL_BATCH, STEPS, EPOCHS = 128, 128, 3
CORES = (0, 1)  # compute rank r runs on core CORES[r - 1]
GROUPS = [
    {"name": "a", "device_type": "cpu", "workers": 1},
    {"name": "b", "device_type": "cpu", "workers": 1},
]


def one_run(hidden: int, on: bool, found: dict[str, list[float]]) -> float:
    """Train once; returns the training seconds and appends the checks' seconds (on) and the
    alarm count to ``found``."""
    run = run_task(
        {
            "code": workload("sized_mlp"),
            "epochs": EPOCHS,
            "global_batch_size": GLOBAL_BATCH,
            "groups": GROUPS,
            "on_disagreement": "fail" if on else "off",
        },
        timeout_s=1800,
        env={
            "POLYTRAIN_BENCH_HIDDEN": str(hidden),
            "POLYTRAIN_BENCH_ITEMS": str(GLOBAL_BATCH * STEPS),
        },
        on_spawn=lambda pids: [pin(pids[r], CORES[r - 1]) for r in (1, 2)],
    )
    train_s = sum(t for t in run.metrics("epoch_time_s", rank=0) if t is not None)
    found["alarms"].append(float(sum(e["type"] == "alarm" for e in run.events)))
    if on:
        checks = [v for v in run.metrics("agreement_check_s", rank=0) if v is not None]
        found["check_s"].append(checks[-1])
        found["on_train_s"].append(train_s)
    return train_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="880,3030", help="hidden widths H")
    args = parser.parse_args()
    worst = 0.0
    by_size: dict[str, Any] = {}
    for hidden in (int(h) for h in args.sizes.split(",")):
        params = 256 * hidden + hidden + hidden * hidden + hidden + hidden * 10 + 10
        found: dict[str, list[float]] = {"check_s": [], "on_train_s": [], "alarms": []}
        arms = {
            "on": lambda h=hidden, f=found: one_run(h, True, f),
            "off": lambda h=hidden, f=found: one_run(h, False, f),
        }
        times = paired_rounds(arms, args.rounds)
        direct = summary(paired_ratios(found["check_s"], found["on_train_s"]))
        ab = summary(paired_ratios(times["on"], times["off"]))
        size = f"{params / 1e6:.2g}M"
        worst = max(worst, direct["median"])
        by_size[size] = {"value": direct["median"], "ci95": direct["ci95"], "on_over_off": ab}
        emit(
            f"agreement_overhead_{size}",
            direct["median"],
            "<= 0.01",
            ideal=0.0,
            parameters=params,
            ci95=direct["ci95"],
            values=direct["values"],
            check_s=[round(s, 4) for s in found["check_s"]],
            train_s={k: [round(s, 3) for s in v] for k, v in times.items()},
            on_over_off=ab,
            alarms=int(sum(found["alarms"])),
            steps=STEPS * EPOCHS,
            parameter_checks=STEPS * EPOCHS // 100,
            rounds=args.rounds,
        )
    emit("agreement_overhead", worst, "<= 0.01", ideal=0.0, by_size=by_size)


if __name__ == "__main__":
    main()
