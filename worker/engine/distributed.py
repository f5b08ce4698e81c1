"""Process-group setup behind small typed objects (after Lightning Fabric's cluster environments).

:class:`ClusterEnv` says where this process sits (read from environment
variables, never module globals); :func:`init` joins the world and builds the
:class:`Topology`: one subgroup per resource group, one leaders group
(parameter server + first rank of each group) for the parameter server's
exchange, and, for the synchronous strategy's step path, the group leaders
without the parameter server (``cross``) and every compute worker (``workers``).

Connections grow with the groups, not the world (docs/scaling.md, point 6): the world
group and the groups spanning groups (leaders, ``cross``, ``workers``) are gloo groups that
connect a pair of ranks on its first use only (gloo's lazy init), and no collective runs on
the world. Only a resource group's own group is a full mesh, connected when it is built.
The control collectives every rank takes part in (:func:`barrier`,
:func:`all_gather_objects`, :func:`gather_objects`, :func:`broadcast_object_from`,
:func:`all_reduce_control`) run in two levels: inside each group on its own process group
(:attr:`Topology.control_group`), then between the parameter server and each group leader,
point to point (a star: one connection per group), then back down inside each group.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from worker.engine import report
from worker.engine.spec import RunSpec

DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ClusterEnv:
    """Rank, world size and rendezvous address of this process (torch.distributed names)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClusterEnv:
        """Read ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``.

        Raises KeyError naming a missing variable, ValueError for a non-integer one.
        """
        env = os.environ if environ is None else environ
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise KeyError(f"missing environment variables: {', '.join(missing)}")
        return cls(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
        )


@dataclass(frozen=True)
class Topology:
    """This process's place in the task's process groups.

    ``group`` and ``group_ranks`` are None/empty on the parameter server;
    ``device`` is where the model and in-group collectives live (CPU on the
    parameter server and in gloo groups). The leaders group is always gloo, on CPU.
    ``cross`` (gloo, CPU) holds the group leaders without the parameter server: set on
    the leaders when there is more than one group, None elsewhere. ``workers`` (gloo)
    holds every compute worker: set on the workers, None on the parameter server.
    ``control`` is a gloo group over ``group_ranks`` for the control collectives of a group
    whose own backend is not gloo (nccl, hccl); None where ``group`` is gloo (it serves).
    """

    rank: int
    world_size: int
    n_workers: int
    group_index: int | None
    group: dist.ProcessGroup | None
    group_ranks: tuple[int, ...]
    leaders: dist.ProcessGroup
    device: torch.device
    cross: dist.ProcessGroup | None = None
    workers: dist.ProcessGroup | None = None
    control: dist.ProcessGroup | None = None

    @property
    def control_group(self) -> dist.ProcessGroup | None:
        """The gloo group of this worker's resource group (CPU tensors and objects); None on
        the parameter server."""
        return self.control if self.control is not None else self.group

    @property
    def is_ps(self) -> bool:
        """True on rank 0, the parameter server."""
        return self.rank == 0

    @property
    def am_i_leader(self) -> bool:
        """True on the first rank of a resource group (it talks to the parameter server)."""
        return bool(self.group_ranks) and self.rank == self.group_ranks[0]

    @property
    def leader_rank(self) -> int | None:
        """Global rank of this process's group leader, None on the parameter server."""
        return self.group_ranks[0] if self.group_ranks else None

    @property
    def worker_index(self) -> int:
        """Index of this compute worker among all workers (``rank - 1``); -1 on the PS."""
        return self.rank - 1


# The compute worker that keeps the parameter server's replica up to date (replicated
# strategies), and the one that reads the fixed batch of the agreement check.
FIRST_WORKER = 1


def pick_device(device_type: str, local_rank: int) -> torch.device:
    """The torch device for a group's ``device_type``; falls back to CPU, with a log line,
    when that device is not available on this host."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    npu = getattr(torch, "npu", None)
    if device_type == "npu" and npu is not None and npu.is_available():
        return torch.device("npu", local_rank)
    if device_type != "cpu":
        report.log(f"device_type {device_type} not available here; using cpu")
    return torch.device("cpu")


def _group_backend(device: torch.device) -> str:
    return {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")


def rendezvous_store(env: ClusterEnv, timeout: timedelta) -> dist.TCPStore:
    """The world's rendezvous store (torch.distributed's TCPStore), hosted by rank 0.

    On rank 0 a ``master_port`` of 0 makes the store listen on a port the
    kernel picks, and the port is reported as a ``rendezvous`` event
    (:mod:`worker.engine.report`) for the agent to hand to the other ranks:
    no other process can take the port between its choice and its use, as it
    could if the agent chose a free port for rank 0 to bind later. Other ranks
    connect to ``master_addr:master_port``, retrying until ``timeout``.
    Raises DistNetworkError if the port cannot be bound or reached in time.
    """
    host = env.rank == 0
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        host,
        timeout=timeout,
        wait_for_workers=False,
    )
    if host and env.master_port == 0:
        report.emit({"type": "rendezvous", "port": store.port})
    return store


LAZY_INIT = "TORCH_GLOO_LAZY_INIT"


@contextmanager
def lazy_gloo() -> Iterator[None]:
    """Gloo process groups built inside connect a pair of ranks on the pair's first use only
    (``TORCH_GLOO_LAZY_INIT``, read when a gloo group is constructed), instead of every pair
    when built; the variable is put back on leaving."""
    before = os.environ.get(LAZY_INIT)
    os.environ[LAZY_INIT] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[LAZY_INIT]
        else:
            os.environ[LAZY_INIT] = before


def lazy_group(ranks: list[int], timeout: timedelta | None = None) -> dist.ProcessGroup:
    """A gloo group over ``ranks`` that connects only the pairs its operations use (every rank
    of the world calls it, in the same order: torch's ``new_group``, whose non-members only
    count the group, with no store round)."""
    with lazy_gloo():
        return dist.new_group(ranks, timeout=timeout, backend="gloo")


def init(env: ClusterEnv, spec: RunSpec, timeout_s: float = DEFAULT_TIMEOUT_S) -> Topology:
    """Join the world (gloo, :func:`rendezvous_store` at ``env.master_addr:master_port``) and
    build groups.

    Safe to call twice: the world is initialised once; groups are created
    again, in the same order on every rank, so every rank must call it alike.
    Returns once every rank has built every group of its own (:func:`barrier`).
    ``timeout_s`` (seconds) bounds rendezvous and every later collective.
    Raises ValueError if ``env.world_size`` differs from ``spec.world_size``,
    RuntimeError/DistStoreError when peers do not arrive in time.

    Only a resource group's own group connects its members when built (a full mesh of its
    W members, W(W - 1) / 2 connections; a CUDA or NPU group has a ``control`` gloo group of
    the same members too, connected on use, which its control collectives' barrier makes a
    full mesh as well). The world, the leaders, ``cross`` and
    ``workers`` connect a pair on its first use (:func:`lazy_gloo`); no collective runs on the
    world, so it connects only the pairs that exchange point to point on it. A non-member's
    ``new_group`` call writes nothing to the store (torch's default, no
    ``TORCH_DIST_INIT_BARRIER``): each rank's store rounds are those of its own groups.
    """
    if env.world_size != spec.world_size:
        raise ValueError(f"WORLD_SIZE={env.world_size} but the spec needs {spec.world_size}")
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        with lazy_gloo():
            dist.init_process_group(
                "gloo",
                store=rendezvous_store(env, timeout),
                rank=env.rank,
                world_size=env.world_size,
                timeout=timeout,
            )
    my_index = None if env.rank == 0 else spec.group_of(env.rank)
    device = torch.device("cpu")
    if my_index is not None:
        device = pick_device(spec.groups[my_index].device_type, env.local_rank)
    my_group = my_control = None
    for index in range(len(spec.groups)):
        # Every rank must create every group, in the same order, members or not (torch's
        # use_local_synchronization names a group by the number of groups its creator made
        # before, which differs between a group's members here: pytorch#173608).
        backend = _group_backend(device) if index == my_index else "gloo"
        group = dist.new_group(spec.group_ranks(index), timeout=timeout, backend=backend)
        if index == my_index:
            my_group = group
        if spec.groups[index].device_type in ("cuda", "npu"):
            # The group's own backend may be nccl/hccl: its control collectives (CPU objects
            # and tensors) take a gloo group of the same members.
            control = lazy_group(spec.group_ranks(index), timeout)
            if index == my_index and backend != "gloo":
                my_control = control
    leaders = lazy_group([0, *spec.leader_ranks()], timeout)
    cross = None
    if len(spec.groups) > 1:
        cross = lazy_group(spec.leader_ranks(), timeout)
    workers = lazy_group(list(range(1, env.world_size)), timeout)
    topo = Topology(
        rank=env.rank,
        world_size=env.world_size,
        n_workers=spec.n_workers,
        group_index=my_index,
        group=my_group,
        group_ranks=tuple(spec.group_ranks(my_index)) if my_index is not None else (),
        leaders=leaders,
        device=device,
        cross=cross if my_index is not None and env.rank in spec.leader_ranks() else None,
        workers=workers if my_index is not None else None,
        control=my_control,
    )
    # Every rank has finished connecting every group before any goes on: a rank that fails
    # right after (say in the user's build_model) cannot break a peer's group set-up, so each
    # rank fails on the user's error itself and its output shows that error.
    barrier(topo)
    return topo


# Point-to-point messages of the control collectives between the parameter server and the
# group leaders carry this tag, so that they never match a receive of the exchange's rounds
# on the same group (``worker.engine.exchange``: tags from 0, one per chunk, any source).
CONTROL_TAG = 1 << 24


def _send_object(obj: Any, dst: int, group: dist.ProcessGroup) -> None:
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    dist.send(
        torch.tensor([data.numel()], dtype=torch.int64), dst=dst, group=group, tag=CONTROL_TAG
    )
    dist.send(data, dst=dst, group=group, tag=CONTROL_TAG)


def _recv_object(src: int, group: dist.ProcessGroup) -> Any:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group, tag=CONTROL_TAG)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src=src, group=group, tag=CONTROL_TAG)
    return pickle.loads(data.numpy().tobytes())


def _leader_ranks(topo: Topology) -> list[int]:
    """The group leaders' global ranks, in group order (the leaders' group less rank 0)."""
    return [r for r in dist.get_process_group_ranks(topo.leaders) if r != 0]


def _up_and_down(topo: Topology, mine: Any, combine: Any) -> Any:
    """The star between the parameter server and the group leaders: each leader sends
    ``mine`` (its group's part) to rank 0, which returns ``combine(its own, [the groups'
    parts in group order])`` to every leader and keeps it. Call on rank 0 and the leaders."""
    if topo.is_ps:
        parts = [_recv_object(leader, topo.leaders) for leader in _leader_ranks(topo)]
        result = combine(mine, parts)
        for leader in _leader_ranks(topo):
            _send_object(result, leader, topo.leaders)
        return result
    _send_object(mine, 0, topo.leaders)
    return _recv_object(0, topo.leaders)


def _group_broadcast(topo: Topology, obj: Any, src: int) -> Any:
    """``obj`` from global rank ``src`` of this worker's group to each member of it."""
    group = topo.control_group
    if len(topo.group_ranks) == 1 or group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(topo: Topology) -> None:
    """Every rank of the world waits for every other: in each group, then between the
    parameter server and the leaders, then in each group again (no world collective)."""
    group = topo.control_group
    if group is not None and len(topo.group_ranks) > 1:
        dist.barrier(group=group)
    if topo.is_ps or topo.am_i_leader:
        _up_and_down(topo, None, lambda _own, _parts: None)
    if group is not None and len(topo.group_ranks) > 1:
        dist.barrier(group=group)


def all_gather_objects(topo: Topology, obj: Any) -> list[Any]:
    """Every rank's ``obj``, on every rank, indexed by global rank (what the world's
    ``all_gather_object`` gives), through the groups and the leaders."""
    if topo.is_ps:
        mine: Any = [obj]
    else:
        group = topo.control_group
        mine = [obj]
        if len(topo.group_ranks) > 1 and group is not None:
            mine = [None] * len(topo.group_ranks)
            dist.all_gather_object(mine, obj, group=group)
    result: Any = None
    if topo.is_ps or topo.am_i_leader:
        result = _up_and_down(topo, mine, lambda own, parts: [*own, *(x for p in parts for x in p)])
    if topo.is_ps:
        return list(result)
    return list(_group_broadcast(topo, result, topo.group_ranks[0]))


def gather_objects(topo: Topology, obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` at rank 0, indexed by global rank (the world's ``gather_object``
    to rank 0), through the groups and the leaders; None on every other rank."""
    if topo.is_ps:
        parts = [_recv_object(leader, topo.leaders) for leader in _leader_ranks(topo)]
        return [obj, *(x for part in parts for x in part)]
    group = topo.control_group
    leader = topo.group_ranks[0]
    mine: list[Any] | None = [obj]
    if len(topo.group_ranks) > 1 and group is not None:
        mine = [None] * len(topo.group_ranks) if topo.am_i_leader else None
        dist.gather_object(obj, mine, dst=leader, group=group)
    if topo.am_i_leader:
        _send_object(mine, 0, topo.leaders)
    return None


def broadcast_object_from(topo: Topology, obj: Any, src: int = 0) -> Any:
    """``obj`` of global rank ``src`` on every rank (ignored elsewhere): inside ``src``'s
    group first, then through the parameter server to the other leaders, then inside
    their groups."""
    in_src_group = src in topo.group_ranks
    if in_src_group:
        obj = _group_broadcast(topo, obj, src)
    if topo.is_ps:
        src_leader = None
        if src != 0:  # the leader of src's group (a group's ranks are contiguous, in order)
            src_leader = max(r for r in _leader_ranks(topo) if r <= src)
            obj = _recv_object(src_leader, topo.leaders)
        for leader in _leader_ranks(topo):
            if leader != src_leader:
                _send_object(obj, leader, topo.leaders)
        return obj
    if topo.am_i_leader:
        if in_src_group:
            _send_object(obj, 0, topo.leaders)
        else:
            obj = _recv_object(0, topo.leaders)
    if not in_src_group:
        obj = _group_broadcast(topo, obj, topo.group_ranks[0])
    return obj


def all_reduce_control(
    topo: Topology, tensor: torch.Tensor, op: Literal["sum", "max"] = "sum"
) -> None:
    """Reduce a CPU ``tensor`` over every rank of the world, in place (the world's
    ``all_reduce``), through the groups and the leaders: inside each group, then at the
    parameter server (its own first, then the groups' in group order), then back down.

    Exact where each rank fills slots of its own and leaves the rest zero (a table of
    counts or seconds, one column per worker), and for ``max``; a sum of overlapping
    floats may round differently from the world's ring.
    """
    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    group = topo.control_group
    if not topo.is_ps and group is not None and len(topo.group_ranks) > 1:
        dist.all_reduce(tensor, op=reduce_op, group=group)

    def combine(own: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
        out = own.clone()
        for part in parts:
            out = out + part if op == "sum" else torch.maximum(out, part)
        return out

    if topo.is_ps or topo.am_i_leader:
        tensor.copy_(_up_and_down(topo, tensor, combine))
    if not topo.is_ps:
        tensor.copy_(_group_broadcast(topo, tensor, topo.group_ranks[0]))


def destroy() -> None:
    """Leave the world if joined; a no-op otherwise."""
    if dist.is_initialized():
        dist.destroy_process_group()
