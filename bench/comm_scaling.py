"""Benchmark ``comm_scaling``: the cross-group exchange against a gloo allreduce, 1-8 groups.

For G = 1, 2, 4 and 8 groups of one worker each (G + 1 processes: a parameter
server and G leaders) and float32 vectors of 0.1, 1, 16 and 64 MB (MB = 2**20
bytes), three arms run in the same processes, side by side:

- ``ps_round``: the parameter-server round that the periodic and quorum
  strategies use, leaders → server → leaders
  (:func:`worker.engine.exchange.push_up` / :func:`gather_at_ps`, then
  :func:`broadcast_down`). The server's link carries G vectors in and G out.
- ``allreduce_world``: ``torch.distributed.all_reduce`` (gloo, sum, one call,
  no buckets) of the same bytes among the same G + 1 processes.
- ``allreduce_leaders``: the same among the G leaders only, as ``sync``'s step sums
  across groups: the leaders' ring of two-rank links
  (:class:`worker.engine.ring.LeaderRing`; for G = 2 their one link's gloo allreduce),
  no parameter server per step (G = 1: a no-op, not measured). Until 2026-11-30 a gloo
  group of the leaders.

Timing: every rank times its part after a barrier and the round's figure is
the slowest rank's (max over ranks, gathered after the clock stops); below
16 MB a measurement is the best of 3 such calls, from 16 MB one call. Each
(G, size) pair runs ``--rounds`` paired rounds (at least 5) after a warm-up,
the arms' order reversed every other round (:func:`bench.stats.paired_rounds`);
an arm's figure is its median over rounds, and the reported ratios
``ps_round / allreduce_world`` and ``ps_round / allreduce_leaders`` are medians of
the per-round ratios with a 95 % bootstrap interval (:func:`bench.stats.summary`).

Fit, per G and arm: ``seconds = alpha + bytes / beta`` over the four sizes by
least squares of the relative residuals (:func:`fit_latency_bandwidth`); alpha
in ms, beta in MB/s of the vector's bytes (the parameter server's link carries
G such vectors each way, so its own rate is 2 G beta) and R^2.

On this 2-core host, G >= 2 oversubscribes the cores (G + 1 busy processes):
the lines say so (``oversubscribed``), and the figures there measure the
processes' CPU time sharing as much as the link.

One JSON line per G (value = the median ratio ps_round / allreduce_world at
64 MB; no target: a curve to read), then ``comm_scaling_fit`` with every fit.

    python -m bench.comm_scaling [--groups 1 2 4 8] [--rounds 5] [--sizes-mb 0.1 1 16 64]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.comm import join_ps_world
from bench.common import cores, emit
from bench.stats import paired_ratios, paired_rounds, summary
from worker.engine import distributed
from worker.engine.distributed import leader_ring
from worker.engine.exchange import broadcast_down, gather_at_ps, push_up
from worker.engine.ranks import free_port

MB = 2**20
SIZES_MB = (0.1, 1.0, 16.0, 64.0)
GROUPS = (1, 2, 4, 8)
MIN_ROUNDS = 5
SMALL_REPS = 3  # calls per measurement below 16 MB (best of), where one call is noisy
ARMS = ("ps_round", "allreduce_world", "allreduce_leaders")


@dataclass(frozen=True)
class Fit:
    """``seconds = alpha_s + bytes / beta_bytes_s`` and the fit's coefficient of determination."""

    alpha_s: float
    beta_bytes_s: float
    r2: float

    def as_dict(self) -> dict[str, float]:
        """``{"alpha_ms", "beta_mb_s", "r2"}``, rounded (MB = 2**20 bytes)."""
        return {
            "alpha_ms": round(self.alpha_s * 1000, 3),
            "beta_mb_s": round(self.beta_bytes_s / MB, 1),
            "r2": round(self.r2, 4),
        }


def fit_latency_bandwidth(nbytes: Sequence[float], seconds: Sequence[float]) -> Fit:
    """Line ``seconds = alpha + bytes / beta`` (the alpha-beta, or Hockney, model) by least
    squares of the relative residuals.

    ``nbytes`` and ``seconds`` (positive) are equally long, at least 2 points of at
    least 2 different sizes. The residuals are weighted by 1 / seconds (minimising
    the sum of ``((alpha + bytes / beta - seconds) / seconds) ** 2``, ``numpy.linalg.lstsq``):
    the sizes span three decades, and a plain fit in seconds lets the largest
    size set the intercept (negative alphas). Returns alpha in seconds, beta in
    bytes/s (1 / slope; ``inf`` when the slope is not positive) and R^2 of the
    fitted line against the timings in seconds (1 - SS_res / SS_tot).

    Raises:
        ValueError: fewer than 2 points, a length mismatch, one size only, or a
            timing that is not positive.
    """
    if len(nbytes) != len(seconds):
        raise ValueError(f"{len(nbytes)} sizes against {len(seconds)} timings")
    if len(nbytes) < 2 or len(set(nbytes)) < 2:
        raise ValueError("the fit needs at least two different sizes")
    x, y = np.asarray(nbytes, float), np.asarray(seconds, float)
    if (y <= 0).any():
        raise ValueError("timings must be positive")
    design = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
    (alpha, slope), *_ = np.linalg.lstsq(design, np.ones_like(y), rcond=None)
    residual = ((alpha + slope * x - y) ** 2).sum()
    total = ((y - y.mean()) ** 2).sum()
    return Fit(
        alpha_s=float(alpha),
        beta_bytes_s=float(1.0 / slope) if slope > 0 else float("inf"),
        r2=float(1.0 - residual / total) if total > 0 else 1.0,
    )


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (an allreduce MAX over the world)."""
    box = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box[0])


def timed(fn: Callable[[], Any], reps: int) -> Callable[[], float]:
    """A measurement: the best of ``reps`` calls of ``fn`` on every rank, each after a
    barrier and each the slowest rank's seconds."""

    def once() -> float:
        dist.barrier()
        started = time.perf_counter()
        fn()
        return slowest(time.perf_counter() - started)

    return lambda: min(once() for _ in range(reps))


def warm_paired(
    arms: dict[str, Callable[[], Any]], reps: int, rounds: int
) -> dict[str, list[float]]:
    """Each arm's seconds (:func:`timed`, best of ``reps``) in ``rounds`` paired rounds
    (:func:`bench.stats.paired_rounds`), after one warm-up call of each (connections,
    buffers). Every rank calls it alike."""
    measures = {name: timed(fn, reps) for name, fn in arms.items()}
    for measure in measures.values():
        measure()
    return paired_rounds(measures, rounds)


def _rank(rank: int, port: int, groups: int, sizes: list[int], rounds: int, out: Any) -> None:
    topo = join_ps_world(rank, port, groups, timeout_s=300)
    members, timeout = list(range(1, groups + 1)), timedelta(seconds=300)
    ring = leader_ring(members, rank, {}, timeout)
    for nbytes in sizes:
        vector = torch.ones(nbytes // 4)

        def ps_round(vector: torch.Tensor = vector) -> None:
            if topo.is_ps:
                broadcast_down(topo, gather_at_ps(topo, vector.numel(), vector.dtype))
            else:
                push_up(topo, vector)
                broadcast_down(topo, vector)

        def allreduce_world(vector: torch.Tensor = vector) -> None:
            dist.all_reduce(vector)

        def allreduce_leaders(vector: torch.Tensor = vector) -> None:
            if ring is not None:
                ring.all_reduce(vector)

        arms = {"ps_round": ps_round, "allreduce_world": allreduce_world}
        if groups > 1:
            arms["allreduce_leaders"] = allreduce_leaders
        values = warm_paired(arms, SMALL_REPS if nbytes < 16 * MB else 1, rounds)
        if rank == 0:
            out[nbytes] = values
    distributed.destroy()


def measure_groups(groups: int, sizes: list[int], rounds: int) -> dict[int, dict[str, list[float]]]:
    """Per vector size in bytes, each arm's seconds per paired round, with ``groups`` groups."""
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(free_port(), groups, sizes, rounds, out), nprocs=groups + 1)
    return dict(out)


def _by_size(summaries: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{"<size>MB": {"median", "ci95", "rounds"}}`` of per-size ratio summaries."""
    keep = ("median", "ci95", "rounds")
    return {f"{round(n / MB, 2):g}MB": {k: s[k] for k in keep} for n, s in summaries.items()}


def report(groups: int, by_size: dict[int, dict[str, list[float]]]) -> dict[str, Any]:
    """The JSON line of one G: per arm the median seconds per size and its fit, the paired
    ratios ps_round / allreduce_world and ps_round / allreduce_leaders per size."""
    sizes = sorted(by_size)
    arms = [a for a in ARMS if a in by_size[sizes[0]]]
    medians = {a: [float(np.median(by_size[n][a])) for n in sizes] for a in arms}
    fits = {a: fit_latency_bandwidth(sizes, medians[a]).as_dict() for a in arms}
    ratios = {
        n: summary(paired_ratios(by_size[n]["ps_round"], by_size[n]["allreduce_world"]), 3)
        for n in sizes
    }
    to_leaders = {
        n: summary(paired_ratios(by_size[n]["ps_round"], by_size[n]["allreduce_leaders"]), 3)
        for n in sizes
        if "allreduce_leaders" in by_size[n]
    }
    busy = groups + 1
    return emit(
        "comm_scaling",
        ratios[sizes[-1]]["median"],
        "none (curve): ps_round / allreduce_world at the largest size",
        groups=groups,
        processes=busy,
        cores=cores(),
        oversubscribed=busy > cores(),
        sizes_mb=[round(n / MB, 2) for n in sizes],
        median_ms={a: [round(s * 1000, 3) for s in medians[a]] for a in arms},
        fit=fits,
        ratio_ps_round_to_allreduce_world=_by_size(ratios),
        ratio_ps_round_to_allreduce_leaders=_by_size(to_leaders),
        load_avg_1m=round(os.getloadavg()[0], 2),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, nargs="+", default=list(GROUPS))
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=list(SIZES_MB))
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    args = parser.parse_args()
    sizes = sorted({int(mb * MB) // 4 * 4 for mb in args.sizes_mb})
    started = time.monotonic()
    lines = [report(g, measure_groups(g, sizes, args.rounds)) for g in args.groups]
    emit(
        "comm_scaling_fit",
        max(line["fit"]["ps_round"]["alpha_ms"] for line in lines),
        "none (curve): worst ps_round alpha, ms",
        unit="ms",
        model="seconds = alpha + bytes / beta, least squares of relative residuals, per G",
        by_groups={
            line["groups"]: {"oversubscribed": line["oversubscribed"], **line["fit"]}
            for line in lines
        },
        rounds=args.rounds,
        seconds=round(time.monotonic() - started, 1),
    )


if __name__ == "__main__":
    main()
