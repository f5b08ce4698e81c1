"""Process-group setup behind small typed objects (after Lightning Fabric's cluster environments).

:class:`ClusterEnv` says where this process sits (read from environment
variables, never module globals); :func:`init` joins the world and builds the
:class:`Topology`: one subgroup per resource group, one leaders group
(parameter server + first rank of each group) for the parameter server's
exchange, and, for the synchronous strategy's step path, the group leaders
without the parameter server (``cross``) and every compute worker (``workers``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

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


def init(env: ClusterEnv, spec: RunSpec, timeout_s: float = DEFAULT_TIMEOUT_S) -> Topology:
    """Join the world (gloo, :func:`rendezvous_store` at ``env.master_addr:master_port``) and
    build groups.

    Safe to call twice: the world is initialised once; groups are created
    again, in the same order on every rank, so every rank must call it alike.
    Returns once every rank has built every group (a barrier).
    ``timeout_s`` (seconds) bounds rendezvous and every later collective.
    Raises ValueError if ``env.world_size`` differs from ``spec.world_size``,
    RuntimeError/DistStoreError when peers do not arrive in time.
    """
    if env.world_size != spec.world_size:
        raise ValueError(f"WORLD_SIZE={env.world_size} but the spec needs {spec.world_size}")
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
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
    my_group = None
    for index in range(len(spec.groups)):
        # Every rank must create every group, in the same order, members or not.
        backend = _group_backend(device) if index == my_index else "gloo"
        group = dist.new_group(spec.group_ranks(index), timeout=timeout, backend=backend)
        if index == my_index:
            my_group = group
    leaders = dist.new_group([0, *spec.leader_ranks()], timeout=timeout, backend="gloo")
    cross = None
    if len(spec.groups) > 1:
        cross = dist.new_group(spec.leader_ranks(), timeout=timeout, backend="gloo")
    workers = dist.new_group(list(range(1, env.world_size)), timeout=timeout, backend="gloo")
    # Every rank has finished connecting every group before any goes on: a rank that fails
    # right after (say in the user's build_model) cannot break a peer's group set-up, so each
    # rank fails on the user's error itself and its output shows that error.
    dist.barrier()
    return Topology(
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
    )


def destroy() -> None:
    """Leave the world if joined; a no-op otherwise."""
    if dist.is_initialized():
        dist.destroy_process_group()
