"""Benchmarks ``allreduce_vs_tcp`` and ``ps_round_vs_bound``: the engine's communication
against raw loopback TCP measured in the same run.

- raw TCP: two processes, one loopback connection (``sendall`` / ``recv_into``
  into a preallocated buffer). The reference is the link's rate per direction
  when both directions are in use: a two-rank allreduce sends and receives at
  once (the bus-bandwidth formula counts one direction of a link used in
  both), and the parameter server's bound overlaps receiving with sending.
  On loopback both directions are memory copies by the same two CPUs, so the
  one-way rate (one process sends, the other receives) is not what each
  direction gets when both are busy. Reference = the higher of the rate
  measured with each process sending ``size`` bytes while receiving as many
  (simultaneous), and half the one-way rate (what alternating directions
  always gives). All three are reported.
- ``allreduce_vs_tcp``: two processes sum a float32 vector with the engine's
  in-group allreduce (:func:`worker.engine.exchange.allreduce_sum`, gloo,
  bucketed); bus bandwidth = 2 (n - 1) / n * bytes / seconds, for vectors of
  4, 16 and 64 MB; value = the smallest ratio to TCP both ways over those
  sizes. Target >= 0.5.
- ``ps_round_vs_bound``: a parameter server and G one-worker groups run
  the engine's round (:func:`push_up` / :func:`gather_at_ps`, then
  :func:`broadcast_down`) on a 16 MB vector; value = round seconds / (G *
  bytes / TCP bandwidth both ways): the server's link carries G vectors in and
  G out, overlapped at best. Target <= 1.5.

Every figure is the best of 7 repetitions after a warm-up (each collective
after a barrier), the usual way to measure what a link can do on a host that
other work shares, and the best of ``--rounds`` rounds that alternate TCP and
the engine; both sides of each ratio are measured the same way.

    python -m bench.comm [--groups 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import emit
from contracts.plan import GroupPlan
from worker.engine import distributed
from worker.engine.distributed import ClusterEnv, Topology
from worker.engine.exchange import allreduce_sum, broadcast_down, gather_at_ps, push_up
from worker.engine.ranks import free_port
from worker.engine.spec import RunSpec

MB = 2**20
SIZES = (4 * MB, 16 * MB, 64 * MB)
REPS = 7


def _receive(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        got += conn.recv_into(view[got:])


def _exchange(conn: socket.socket, payload: memoryview, view: memoryview) -> None:
    """Send ``payload`` (from a thread) while receiving as many bytes into ``view``."""
    sender = threading.Thread(target=conn.sendall, args=(payload,))
    sender.start()
    _receive(conn, view)
    sender.join()


def _peer(port: int, nbytes: int, reps: int, both_ways: bool) -> None:
    with socket.create_server(("127.0.0.1", port)) as server:
        conn, _ = server.accept()
        view, payload = memoryview(bytearray(nbytes)), memoryview(bytearray(nbytes))
        for _ in range(reps + 1):
            if both_ways:
                _receive(conn, view[:1])  # the other side's start signal
                _exchange(conn, payload, view)
            else:
                _receive(conn, view)
                conn.sendall(b"k")
        conn.close()


def _connect(port: int) -> socket.socket:
    deadline = time.monotonic() + 30
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port))
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def tcp_bandwidth(nbytes: int, reps: int = REPS, *, both_ways: bool = False) -> float:
    """Loopback TCP bytes/s per direction between two processes (best of ``reps`` after a
    warm-up), over one connection.

    One way: one process sends ``nbytes``, the other receives them and acknowledges.
    Both ways: after a one-byte start signal, each process sends ``nbytes`` to the
    other while receiving as many (a thread sends, the main thread receives into a
    preallocated buffer with ``recv_into``), the way a two-rank allreduce or a
    parameter server that receives and sends at once uses the link.
    """
    port = free_port()
    child = mp.get_context("spawn").Process(target=_peer, args=(port, nbytes, reps, both_ways))
    child.start()
    conn, times = _connect(port), []
    view, payload = memoryview(bytearray(nbytes)), memoryview(bytearray(nbytes))
    for _ in range(reps + 1):
        started = time.perf_counter()
        if both_ways:
            conn.sendall(b"g")
            _exchange(conn, payload, view)
        else:
            conn.sendall(payload)
            conn.recv(1)
        times.append(time.perf_counter() - started)
    conn.close()
    child.join()
    return nbytes / min(times[1:])


def _timed(fn: Any, reps: int = REPS) -> float:
    """Best seconds of ``reps`` calls of ``fn`` (each after a barrier), after a warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def _allreduce_rank(rank: int, port: int, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
    )
    group = dist.new_group([0, 1])
    for nbytes in SIZES:
        vector = torch.ones(nbytes // 4)
        seconds = _timed(lambda v=vector: allreduce_sum(v, group))
        if rank == 0:
            out[nbytes] = seconds
    dist.destroy_process_group()


def allreduce_seconds() -> dict[int, float]:
    """Best seconds of the engine's 2-process allreduce per vector size in bytes."""
    out = mp.Manager().dict()
    mp.spawn(_allreduce_rank, args=(free_port(), out), nprocs=2)
    return dict(out)


def join_ps_world(rank: int, port: int, groups: int, timeout_s: float = 120) -> Topology:
    """Join, as ``rank`` (one torch thread), the world of a parameter server (rank 0) and
    ``groups`` one-worker groups on 127.0.0.1:``port`` (:func:`distributed.init`)."""
    torch.set_num_threads(1)
    spec = RunSpec(
        task_id=0,
        code="example:tiny_regression",
        epochs=1,
        global_batch_size=groups,
        groups=[GroupPlan(name=f"g{i}", device_type="cpu", workers=1) for i in range(groups)],
        checkpoint_dir="/tmp/unused",
    )
    env = ClusterEnv(rank=rank, world_size=groups + 1, master_addr="127.0.0.1", master_port=port)
    return distributed.init(env, spec, timeout_s=timeout_s)


def _round_rank(rank: int, port: int, groups: int, nbytes: int, out: Any) -> None:
    topo = join_ps_world(rank, port, groups)
    vector = torch.ones(nbytes // 4)

    def one_round() -> None:
        if topo.is_ps:
            broadcast_down(topo, gather_at_ps(topo, vector.numel(), vector.dtype))
        else:
            push_up(topo, vector)
            broadcast_down(topo, vector)

    seconds = _timed(one_round)
    if topo.is_ps:
        out["round"] = seconds
    distributed.destroy()


def ps_round_seconds(groups: int, nbytes: int) -> float:
    """Best seconds of one parameter-server round with ``groups`` one-worker groups."""
    out = mp.Manager().dict()
    mp.spawn(_round_rank, args=(free_port(), groups, nbytes, out), nprocs=groups + 1)
    return float(out["round"])


def tcp_rates(sizes: tuple[int, ...]) -> dict[str, dict[int, float]]:
    """Loopback TCP bytes/s per size, one way and both ways."""
    return {
        "one_way": {n: tcp_bandwidth(n) for n in sizes},
        "both_ways": {n: tcp_bandwidth(n, both_ways=True) for n in sizes},
    }


def best_of(*measurements: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """The higher TCP rate of every figure over several measurements."""
    first = measurements[0]
    return {k: {n: max(m[k][n] for m in measurements) for n in first[k]} for k in first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    nbytes = 16 * MB
    # Rounds alternate TCP and the engine, and every figure keeps its best round, so a
    # change in the host's load touches both sides of each ratio alike.
    tcps, allreduces, rounds_by_g = [], [], []
    for _ in range(args.rounds):
        tcps.append(tcp_rates(SIZES))
        allreduces.append(allreduce_seconds())
        rounds_by_g.append({g: ps_round_seconds(g, nbytes) for g in sorted({1, args.groups})})
    tcp = best_of(*tcps)
    allreduce = {n: min(a[n] for a in allreduces) for n in SIZES}
    rounds = {g: min(r[g] for r in rounds_by_g) for g in rounds_by_g[0]}
    one, measured_both = tcp["one_way"], tcp["both_ways"]
    # Per direction with both directions in use: what the simultaneous test reached, or
    # half the one-way rate (alternating directions always gives that), whichever is higher.
    both = {n: max(measured_both[n], one[n] / 2) for n in SIZES}
    busbw = {n: n / allreduce[n] for n in SIZES}  # 2 (n - 1) / n = 1 for n = 2 ranks
    ratios = {n: busbw[n] / both[n] for n in SIZES}
    emit(
        "allreduce_vs_tcp",
        min(ratios.values()),
        ">= 0.5",
        bucket_mb=[n // MB for n in SIZES],
        busbw_gb_s=[round(busbw[n] / 1e9, 3) for n in SIZES],
        tcp_both_ways_gb_s=[round(both[n] / 1e9, 3) for n in SIZES],
        ratio=[round(ratios[n], 3) for n in SIZES],
        tcp_simultaneous_gb_s=[round(measured_both[n] / 1e9, 3) for n in SIZES],
        tcp_one_way_gb_s=[round(one[n] / 1e9, 3) for n in SIZES],
        ratio_to_one_way=[round(busbw[n] / one[n], 3) for n in SIZES],
        processes=2,
    )
    bound = {g: g * nbytes / both[nbytes] for g in rounds}
    emit(
        "ps_round_vs_bound",
        rounds[args.groups] / bound[args.groups],
        "<= 1.5",
        groups=args.groups,
        vector_mb=nbytes // MB,
        round_s=round(rounds[args.groups], 5),
        bound_s=round(bound[args.groups], 5),
        tcp_both_ways_gb_s=round(both[nbytes] / 1e9, 3),
        tcp_simultaneous_gb_s=round(measured_both[nbytes] / 1e9, 3),
        tcp_one_way_gb_s=round(one[nbytes] / 1e9, 3),
        ratio_to_one_way_bound=round(rounds[args.groups] * one[nbytes] / (args.groups * nbytes), 3),
        processes=args.groups + 1,
        by_groups={
            g: {"round_s": round(r, 5), "ratio": round(r / bound[g], 3)} for g, r in rounds.items()
        },
    )


if __name__ == "__main__":
    main()
