"""Benchmark ``rebalance_tracking``: how fast the online balancer follows a real change of a
group's speed, and what the lag costs.

Two groups of one worker in CPU cgroups of their own (bench/throttle.py): "fast" pinned to
core 0 with no quota, "slow" pinned to core 1 with a CFS quota. The task (bench/workloads/
hetero_cnn.py, 4,096 samples, global batch 256, 16 steps an epoch, sync every step,
weighted split, a rebalancing check every ``REBALANCE_EVERY`` = 4 steps) runs ``EPOCHS``
epochs; when the parameter server reports step ``CHANGE_AT`` (34 of 64, mid-way between
two checks) the slow group's quota changes while it runs: 1/3 -> 2/3 of a core ("up") or
2/3 -> 1/3 ("down").

Each round (paired, counterbalanced: ``bench.stats.paired_rounds``) also runs, with the
same cgroups, the slow group alone at each quota (``r_slow(q)``), the fast group alone
(``r_fast``) and the fast group alone beside a neighbour, a plain PyTorch loop of the same
model in the slow group's cgroup at each quota (``r_fast_beside(q)``, bench/neighbour.py):
2 epochs each, the second counted. The two cores share caches and memory bandwidth, so
while the slow core computes the fast group runs at ``r_fast_beside(q)``, not ``r_fast``
(about 0.92 of it here), and the split that equalises the step times in the run is the
optimum ``r_slow(q) / (r_fast_beside(q) + r_slow(q))``; the one from the standalone
rates, ``r_slow(q) / (r_fast + r_slow(q))``, is reported beside it. From the parameter
server's log of every rebalance ("rebalance at step N: shares [...] -> [...]") the slow
worker's share after each check is known:

- ``control_points_to_settle``: checks after the change until the slow share is within
  5 % of the new optimum and stays there to the end of the run (None: never); target <= 2
  (``checks``; ``checks_standalone_optimum`` against the standalone optimum;
  ``checks_in_run_optimum`` against the split that equalises the two workers' own
  rates, ``samples_per_s`` (samples over all busy seconds), over the run's last epoch,
  all after the change: measured in the same run, so the host's drift between separate
  runs does not enter it, but one epoch's rate is itself noisy (bench/speed_noise.py)
  and it cannot show a bias of the engine's own timing, which ``lost`` does).
- ``lost``: 1 - oracle / actual seconds over epochs 1..E-1 (epoch 0 warms up), where the
  oracle takes, for each step, the seconds per step ``tau(q)`` of a settled split at the
  quota q in force: epoch 1 of the run that starts at q (before its change: the balancer
  has had epoch 0 to settle at q), i.e. epoch 1 of "up" for 1/3 and of "down" for 2/3, in
  the same round. Target <= 5 %. It also carries the host's noise between the two runs
  (the spread over rounds shows it).

One line per direction (``rebalance_tracking_up``, ``rebalance_tracking_down``) with each
round's share trajectory, then ``rebalance_tracking`` whose value is the worst median
``lost`` and which carries the worst median number of checks. Needs root and the cgroup
v1 cpu controller; exits 2 with a message where it is missing.

    python -m bench.rebalance_tracking [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
from collections.abc import Callable
from typing import Any

from bench.common import emit, ps_metric, run_task, workload
from bench.neighbour import running_beside
from bench.stats import paired_ratios, paired_rounds, summary
from bench.throttle import PERIOD_US, CpuGroup, Throttle, ThrottleError, exit_unavailable, placement
from worker.engine.local import LocalRun

PREFIX = "ptbench-thr"
LOW, HIGH = 1 / 3, 2 / 3
BATCH, SAMPLES, EPOCHS, REBALANCE_EVERY = 256, 4096, 4, 4
STEPS_PER_EPOCH = SAMPLES // BATCH
CHANGE_AT = EPOCHS * STEPS_PER_EPOCH // 2 + REBALANCE_EVERY // 2
TARGET = "lost <= 0.05, settled within 2 checks"
SETTLED = 0.05  # relative distance of the slow share from its optimum
FAST = {"name": "fast", "device_type": "cpu", "workers": 1}
SLOW = {"name": "slow", "device_type": "cpu", "workers": 1}
DIRECTIONS = {"up": (LOW, HIGH), "down": (HIGH, LOW)}
REBALANCE = re.compile(r"rebalance at step (\d+): shares \[[^\]]*\] -> \[([^\]]*)\]")
PROFILED = re.compile(r"profiled samples/s .*; shares \[([^\]]*)\]")


def task(groups: list[dict[str, Any]], epochs: int) -> dict[str, Any]:
    """The RunSpec fields of one run on ``groups``."""
    return {
        "code": workload("hetero_cnn"),
        "epochs": epochs,
        "global_batch_size": BATCH,
        "groups": groups,
        "split_policy": "weighted",
        "rebalance_every": REBALANCE_EVERY,
    }


def epoch_seconds(run: LocalRun) -> list[float]:
    """The parameter server's epoch seconds after the first epoch (which warms up)."""
    return ps_metric(run, "epoch_time_s")[1:]


def slow_shares(run: LocalRun) -> list[tuple[int, int]]:
    """``(step, slow share in samples)``: the initial split at step 0, then every rebalance."""
    shares: list[tuple[int, int]] = []
    for line in run.output[0]:
        if (found := PROFILED.search(line)) is not None:
            shares = [(0, int(found.group(1).split(",")[-1]))]  # the last profiling pass's
        elif (found := REBALANCE.search(line)) is not None:
            shares.append((int(found.group(1)), int(found.group(2).split(",")[-1])))
    return shares


def control_points(steps: int) -> list[int]:
    """Steps after which every rank passes a rebalancing check (every REBALANCE_EVERY
    steps and at every epoch's end)."""
    return [s for s in range(1, steps + 1) if s % REBALANCE_EVERY == 0 or s % STEPS_PER_EPOCH == 0]


def checks_to_settle(shares: list[tuple[int, int]], changed_at: int, optimum: float) -> int | None:
    """Checks after step ``changed_at`` until the slow share (a fraction of BATCH) is within
    SETTLED of ``optimum`` and stays so to the end; None if it never does."""
    after = [c for c in control_points(EPOCHS * STEPS_PER_EPOCH) if c > changed_at]
    within = []
    for check in after:
        share = [b for step, b in shares if step <= check][-1]
        within.append(abs(share / BATCH - optimum) <= SETTLED * optimum)
    for index in range(len(within)):
        if all(within[index:]):
            return index + 1
    return None


def tracking_run(cpu: dict[str, CpuGroup], start: float, end: float) -> dict[str, Any]:
    """One run with the slow quota changed from ``start`` to ``end`` at step CHANGE_AT."""
    cpu["slow"].set_fraction(start)
    changed: list[int] = []

    def watch(event: dict[str, Any]) -> bool:
        if not changed and event["type"] == "progress" and event["step"] >= CHANGE_AT:
            cpu["slow"].set_fraction(end)
            changed.append(int(event["step"]))
        return False

    groups = [FAST, SLOW]
    run = run_task(task(groups, EPOCHS), on_spawn=placement(groups, cpu), stop_when=watch)
    if not changed:
        raise RuntimeError(f"the run ended before step {CHANGE_AT}")
    return {
        "epoch_s": epoch_seconds(run),
        "shares": slow_shares(run),
        "changed_at": changed[0],
        "in_run_optimum": in_run_optimum(run),
    }


def in_run_optimum(run: LocalRun) -> float:
    """The slow share that equalises the two workers' own rates (``samples_per_s``: samples
    over busy seconds) in the run's last epoch, all of it after the change. Rank 1 is the
    fast group's worker, rank 2 the slow one's (rank 0: the parameter server)."""
    last = [run.metrics("samples_per_s", rank=rank)[-1:] for rank in (1, 2)]
    rates = [values[0] if values else None for values in last]
    if any(rate is None or rate <= 0 for rate in rates):
        raise RuntimeError(f"the workers reported no last-epoch samples/s: {rates}")
    fast, slow = rates
    return slow / (fast + slow)  # type: ignore[operator]


def rate(cpu: dict[str, CpuGroup], groups: list[dict[str, Any]], fraction: float) -> float:
    """Samples/s of a run on ``groups`` with the slow quota at ``fraction`` (the second of
    2 epochs)."""
    cpu["slow"].set_fraction(fraction)
    run = run_task(task(groups, 2), on_spawn=placement(groups, cpu))
    return SAMPLES / statistics.median(epoch_seconds(run))


def rate_beside(cpu: dict[str, CpuGroup], fraction: float) -> float:
    """Samples/s of the fast group alone while a neighbour loop of the same model runs in
    the slow group's cgroup at quota ``fraction``."""
    cpu["slow"].set_fraction(fraction)
    with running_beside(workload("hetero_cnn"), BATCH, cpu["slow"]):
        return rate(cpu, [FAST], fraction)


def measure(cpu: dict[str, CpuGroup], rounds: int) -> dict[str, list[Any]]:
    """Every run of every round: the standalone ones and the two tracking runs."""
    arms: dict[str, Callable[[], Any]] = {
        "fast": lambda: rate(cpu, [FAST], LOW),
        "fast beside low": lambda: rate_beside(cpu, LOW),
        "fast beside high": lambda: rate_beside(cpu, HIGH),
        "slow low": lambda: rate(cpu, [SLOW], LOW),
        "slow high": lambda: rate(cpu, [SLOW], HIGH),
        "up": lambda: tracking_run(cpu, *DIRECTIONS["up"]),
        "down": lambda: tracking_run(cpu, *DIRECTIONS["down"]),
    }
    return paired_rounds(arms, rounds)


def direction_figures(runs: dict[str, list[Any]], direction: str) -> dict[str, Any]:
    """Checks to settle and throughput lost per round for one direction."""
    start, end = DIRECTIONS[direction]
    level = {LOW: "low", HIGH: "high"}
    checks: list[int | None] = []
    checks_standalone: list[int | None] = []
    checks_in_run: list[int | None] = []
    lost: list[float] = []
    optima: list[float] = []
    optima_standalone: list[float] = []
    for index, tracked in enumerate(runs[direction]):
        r_fast = runs["fast"][index]
        r_beside = runs[f"fast beside {level[end]}"][index]
        r_slow = runs[f"slow {level[end]}"][index]
        optima.append(r_slow / (r_beside + r_slow))
        optima_standalone.append(r_slow / (r_fast + r_slow))
        checks.append(checks_to_settle(tracked["shares"], tracked["changed_at"], optima[-1]))
        checks_standalone.append(
            checks_to_settle(tracked["shares"], tracked["changed_at"], optima_standalone[-1])
        )
        checks_in_run.append(
            checks_to_settle(tracked["shares"], tracked["changed_at"], tracked["in_run_optimum"])
        )
        settled = {d: runs[d][index]["epoch_s"][0] / STEPS_PER_EPOCH for d in DIRECTIONS}
        tau = {LOW: settled["up"], HIGH: settled["down"]}  # epoch 1, before the change
        timed = range(STEPS_PER_EPOCH + 1, EPOCHS * STEPS_PER_EPOCH + 1)  # epochs 1..E-1
        oracle = sum(tau[start if step <= tracked["changed_at"] else end] for step in timed)
        lost.append(1 - oracle / sum(tracked["epoch_s"]))
    done = [c for c in checks if c is not None]
    return {
        "checks": checks,
        "checks_median": statistics.median(done) if len(done) == len(checks) else None,
        "lost": summary(lost),
        "checks_standalone_optimum": checks_standalone,
        "checks_in_run_optimum": checks_in_run,
        "in_run_optimal_slow_share": summary([r["in_run_optimum"] for r in runs[direction]]),
        "optimal_slow_share": summary(optima),
        "optimal_slow_share_standalone": summary(optima_standalone),
        "contention": summary(paired_ratios(runs[f"fast beside {level[end]}"], runs["fast"])),
        # 2.0 when the quota is what limits the slow group (2/3 against 1/3 of a core)
        "slow_high_over_low": summary(paired_ratios(runs["slow high"], runs["slow low"])),
        "slow_share_steps": [r["shares"] for r in runs[direction]],
        "changed_at_step": [r["changed_at"] for r in runs[direction]],
        "epoch_s": [[round(t, 3) for t in r["epoch_s"]] for r in runs[direction]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="rebalancing after a real change of speed")
    parser.add_argument("--rounds", type=int, default=5, help="paired, counterbalanced")
    parser.add_argument(
        "--period-us", type=int, default=PERIOD_US, help="CFS period of the quotas (µs)"
    )
    args = parser.parse_args()
    try:
        with Throttle(prefix=PREFIX, period_us=args.period_us) as throttle:
            cpu = throttle.fast_and_slow(LOW)
            load = os.getloadavg()[0]
            runs = measure(cpu, args.rounds)
            load_avg = [round(load, 2), round(os.getloadavg()[0], 2)]
    except ThrottleError as err:
        exit_unavailable(err, "bench.rebalance_tracking")
    rates = {
        name: [round(v, 1) for v in runs[name]]
        for name in ("fast", "fast beside low", "fast beside high", "slow low", "slow high")
    }
    lost: list[float] = []
    checks: list[float] = []  # inf: a direction whose share did not settle in some round
    for direction, (start, end) in DIRECTIONS.items():
        found = direction_figures(runs, direction)
        emit(
            f"rebalance_tracking_{direction}",
            found["lost"]["median"],
            TARGET,
            **found,
            quota=[round(start, 4), round(end, 4)],
            period_us=args.period_us,
            samples_per_s=rates,
            change_at_step=CHANGE_AT,
            rebalance_every=REBALANCE_EVERY,
            steps=EPOCHS * STEPS_PER_EPOCH,
            load_avg_1min=load_avg,
        )
        lost.append(found["lost"]["median"])
        median = found["checks_median"]
        checks.append(float("inf") if median is None else median)
    emit(
        "rebalance_tracking",
        max(lost),
        TARGET,
        worst_checks_to_settle=None if max(checks) == float("inf") else max(checks),
        directions=list(DIRECTIONS),
        rounds=args.rounds,
    )


if __name__ == "__main__":
    main()
