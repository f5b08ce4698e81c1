"""Benchmark ``ps_round``: a parameter-server round with the server in 1, 2 and 4 shards, against
a gloo ring allreduce of the same bytes (issue 36, item 2).

G one-worker groups (their leaders) and up to S_max = 4 shard servers, each its own
process, run in the same processes, side by side:

- ``ps_round_s{S}`` for S = 1, 2, 4: every leader cuts its float32 vector into S slices
  (:func:`worker.engine.exchange.shard_bounds`), sends slice s to the owner of shard s and
  takes back that shard's answer (:func:`worker.engine.exchange.sharded_round`); each owner
  sums its slice over the leaders in leader order and answers every leader with it
  (:func:`worker.engine.exchange.serve_shard`). As in the engine
  (:mod:`worker.engine.shard_server`), rank 0 first sends every other owner its command (the
  owners' slices go to rank 0 only before a control point or an epoch's end, not timed
  here). S = 1 is one server, whose link carries G vectors in and G out; with S shards each
  server's link carries G / S of them (BytePS, Jiang et al., OSDI 2020). The shards a round
  does not use wait at the barrier.
- ``allreduce_ring``: the leaders' ring allreduce over two-rank links
  (:class:`worker.engine.ring.LeaderRing`, what ``sync`` sums across groups with), each
  leader sending and receiving 2 (G - 1) / G vectors; no server.
- ``allreduce_gloo``: ``torch.distributed.all_reduce`` (gloo, sum) among the G leaders.

Timing as ``bench.comm_scaling``'s: every rank times its part after a barrier, the round's
figure is the slowest rank's, one call per measurement (sizes of 16 MB and more); ``--rounds``
paired rounds after a warm-up, the arms' order reversed every other round. Per size the
median seconds of each arm and the paired ratios ``ps_round_s{S} / ps_round_s1`` and
``ps_round_s{S} / allreduce_ring`` (median, 95 % bootstrap interval). A shard's share of the
bytes is the model the sharded server's owner holds: 1/S of it.

On this 2-core host G + 4 processes oversubscribe the cores (the line says so,
``oversubscribed``): a shard's server then shares a core with leaders and other shards, so
the figures read what the sharded exchange costs in CPU time and copies here, not what S
links of their own would carry. No target: a curve to read.

    python -m bench.ps_shards [--groups 2] [--sizes-mb 16 64] [--shards 1 2 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.comm_scaling import MB, warm_paired
from bench.common import cores, emit
from bench.stats import paired_ratios, summary
from worker.engine.distributed import leader_ring, shard_links
from worker.engine.exchange import serve_shard, shard_bounds, sharded_round
from worker.engine.ranks import free_port

SIZES_MB = (16.0, 64.0)
SHARDS = (1, 2, 4)
MIN_ROUNDS = 5


def _rank(
    rank: int, port: int, groups: int, shards: list[int], sizes: list[int], rounds: int, out: Any
) -> None:
    torch.set_num_threads(1)
    top = max(shards)
    world, servers_max = groups + top, top
    timeout = timedelta(seconds=300)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timeout
    )
    leaders = list(range(servers_max, world))
    layouts = {s: shard_links(list(range(s)), leaders, rank, timeout) for s in shards}
    # The engine's command from rank 0 to each other owner, over a link of their own.
    back = {k: dist.new_group([0, k], timeout=timeout, backend="gloo") for k in range(1, top)}
    ring = leader_ring(leaders, rank, {}, timeout)
    leaders_group = dist.new_group(leaders, timeout=timeout, backend="gloo")
    for nbytes in sizes:
        numel = nbytes // 4
        vector, answer = torch.ones(numel), torch.empty(numel)

        def ps_round(s: int, vector: torch.Tensor = vector, answer: torch.Tensor = answer) -> None:
            links, bounds = layouts[s], shard_bounds(vector.numel(), s)
            command = torch.zeros(4 + groups, dtype=torch.int64)
            if links.shard == 0:
                for k in range(1, s):
                    dist.send(command, k, back[k])
            elif links.shard is not None:
                dist.recv(command, 0, back[links.shard])
            if links.shard is not None:
                a, b = bounds[links.shard]
                serve_shard(links, b - a, vector.dtype, lambda total: total)
            elif rank in leaders:
                sharded_round(
                    links, [vector[a:b] for a, b in bounds], [answer[a:b] for a, b in bounds]
                )

        def allreduce_ring(vector: torch.Tensor = vector) -> None:
            if ring is not None:
                ring.all_reduce(vector)

        def allreduce_gloo(vector: torch.Tensor = vector) -> None:
            if rank in leaders:
                dist.all_reduce(vector, group=leaders_group)

        arms: dict[str, Any] = {f"ps_round_s{s}": (lambda s=s: ps_round(s)) for s in shards}
        if groups > 1:
            arms |= {"allreduce_ring": allreduce_ring, "allreduce_gloo": allreduce_gloo}
        values = warm_paired(arms, 1, rounds)
        if rank == 0:
            out[nbytes] = values
    dist.destroy_process_group()


def measure(groups: int, shards: list[int], sizes: list[int], rounds: int) -> dict[int, Any]:
    """Per vector size in bytes, each arm's seconds per paired round."""
    out = mp.Manager().dict()
    args = (free_port(), groups, shards, sizes, rounds, out)
    mp.spawn(_rank, args=args, nprocs=groups + max(shards))
    return dict(out)


def report(
    groups: int, shards: list[int], by_size: dict[int, dict[str, list[float]]], seconds: float
) -> dict[str, Any]:
    """The JSON line: per size each arm's median ms and the paired ratios; value = the
    largest size's ``ps_round_s{S_max} / ps_round_s1``."""
    sizes = sorted(by_size)
    arms = list(by_size[sizes[0]])
    label = {n: f"{round(n / MB, 2):g}MB" for n in sizes}
    median_ms = {
        label[n]: {a: round(float(np.median(by_size[n][a])) * 1000, 2) for a in arms} for n in sizes
    }

    def ratios(denominator: str) -> dict[str, dict[str, Any]]:
        return {
            label[n]: {
                f"s{s}": summary(
                    paired_ratios(by_size[n][f"ps_round_s{s}"], by_size[n][denominator]), 3
                )
                for s in shards
                if f"ps_round_s{s}" != denominator
            }
            for n in sizes
            if denominator in by_size[n]
        }

    to_one, to_ring = ratios("ps_round_s1") if 1 in shards else {}, ratios("allreduce_ring")
    top = max(shards)
    value = to_one[label[sizes[-1]]][f"s{top}"]["median"] if to_one and top > 1 else 1.0
    busy = groups + top
    return emit(
        "ps_round",
        value,
        f"none (curve): ps_round with {top} shards / 1 shard at {label[sizes[-1]]}",
        groups=groups,
        shards=shards,
        processes=busy,
        cores=cores(),
        oversubscribed=busy > cores(),
        median_ms=median_ms,
        ratio_to_one_shard=to_one,
        ratio_to_allreduce_ring=to_ring,
        load_avg_1m=round(os.getloadavg()[0], 2),
        seconds=round(seconds, 1),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=list(SIZES_MB))
    parser.add_argument("--shards", type=int, nargs="+", default=list(SHARDS))
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    args = parser.parse_args()
    if args.groups < 1 or min(args.shards) < 1:
        parser.error("--groups and every --shards must be 1 or more")
    sizes = sorted({int(mb * MB) // 4 * 4 for mb in args.sizes_mb})
    shards = sorted(set(args.shards))
    started = time.monotonic()
    by_size = measure(args.groups, shards, sizes, args.rounds)
    report(args.groups, shards, by_size, time.monotonic() - started)


if __name__ == "__main__":
    main()
