"""Process-group setup behind small typed objects (after Lightning Fabric's cluster environments).

:class:`ClusterEnv` says where this process sits (read from environment
variables, never module globals); :func:`init` joins the world (a group that carries
nothing) and builds the :class:`Topology`: one subgroup per resource group, a link (a
two-rank group) between the parameter server and each group leader, and each worker of a
sharded group, for the server's exchange and the control collectives between groups, and
under ``sync`` a ring of links among the group leaders (``cross``, a
:class:`worker.engine.ring.LeaderRing`) for the step path. The control collectives
(:func:`all_reduce_sum` and the rest) go through those; the module's "Process groups"
comment says why.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from worker.engine import report
from worker.engine.ring import LeaderRing, ring_pairs
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
    parameter server and in gloo groups).
    ``links`` (gloo, CPU) are the two-rank groups between the parameter server and a worker
    that talks to it, keyed by that worker's global rank: every group leader, and every
    worker of a sharded group (``sharding: fsdp``, which exchanges its own rows with the
    server), and every other owner of a shard of the server (``shards``, its commands). The
    server holds every link, such a rank its own, others none; :meth:`link` picks one.
    ``cross`` is the group leaders' allreduce without the parameter server, over a ring of
    two-rank gloo groups (``ring_links``, keyed by the pair of global ranks, on every rank:
    a pair without this rank maps to torch's non-member marker): set on the leaders under
    ``sync`` with more than one group, None elsewhere.
    ``control`` (gloo, CPU) holds this rank's resource group, for the control collectives
    (:func:`all_reduce_sum` and the rest): ``group`` itself on a CPU group, a gloo group of
    the same ranks beside a CUDA or NPU group's; None on the parameter server. ``groups``
    lists every resource group's global ranks, in group order. ``timeout`` bounds every
    collective and receive.
    ``shards``: with a parameter server in S > 1 shards (``RunSpec.ps_shards``), or a
    sharded group under ``periodic`` or ``diloco`` (``RunSpec.owner_rounds``: then S may be
    1, rank 0 owning it all), the links between each shard's owner and each compute worker
    (:class:`ShardLinks`), on those ranks; rank 0 then also holds a link to each other owner
    (its commands), which holds that one.
    """

    rank: int
    world_size: int
    n_workers: int
    group_index: int | None
    group: dist.ProcessGroup | None
    group_ranks: tuple[int, ...]
    device: torch.device
    links: Mapping[int, dist.ProcessGroup] = field(default_factory=dict)
    cross: LeaderRing | None = None
    ring_links: Mapping[frozenset[int], dist.ProcessGroup] = field(default_factory=dict)
    control: dist.ProcessGroup | None = None
    groups: tuple[tuple[int, ...], ...] = ()
    timeout: timedelta = timedelta(seconds=DEFAULT_TIMEOUT_S)
    shards: ShardLinks | None = None

    def link(self, peer: int) -> dist.ProcessGroup:
        """The two-rank group to talk to global rank ``peer`` through: on the parameter
        server the link to that worker, on a worker (``peer`` 0) its own. Raises KeyError
        for a pair of ranks without a link (two workers, or a worker that never talks to
        the server)."""
        if self.is_ps:
            return self.links[peer]
        if peer != 0:
            raise KeyError(f"rank {self.rank} has no link to rank {peer}, only to rank 0")
        return self.links[self.rank]

    @property
    def is_ps(self) -> bool:
        """True on rank 0, the parameter server."""
        return self.rank == 0

    @property
    def is_shard_server(self) -> bool:
        """True on a rank that owns a shard of the parameter server other than rank 0's."""
        return not self.is_ps and not self.group_ranks

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


@contextlib.contextmanager
def _gloo_lazy_init() -> Iterator[None]:
    """gloo groups made inside connect a pair of ranks on its first message rather than every
    pair at once (``TORCH_GLOO_LAZY_INIT``); the variable is put back after."""
    before = os.environ.get(LAZY)
    os.environ[LAZY] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[LAZY]
        else:
            os.environ[LAZY] = before


LAZY = "TORCH_GLOO_LAZY_INIT"


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
        # The world group carries nothing (module comment below, "Process groups"): made
        # with gloo's lazy connections, which it never opens, it holds no connection at all.
        with _gloo_lazy_init():
            dist.init_process_group(
                "gloo",
                store=rendezvous_store(env, timeout),
                rank=env.rank,
                world_size=env.world_size,
                timeout=timeout,
            )
    serves = env.rank == 0 or spec.is_shard_server(env.rank)
    my_index = None if serves else spec.group_of(env.rank)
    device = torch.device("cpu")
    if my_index is not None:
        device = pick_device(spec.groups[my_index].device_type, env.local_rank)
    my_group = control = None
    for index in range(len(spec.groups)):
        # Every rank must create every group, in the same order, members or not.
        backend = _group_backend(device) if index == my_index else "gloo"
        group = dist.new_group(spec.group_ranks(index), timeout=timeout, backend=backend)
        if index == my_index:
            my_group = control = group
        if spec.groups[index].device_type != "cpu":  # a gloo twin for the control collectives
            twin = dist.new_group(spec.group_ranks(index), timeout=timeout, backend="gloo")
            if index == my_index:
                control = twin
    links = {}
    for peer in linked_ranks(spec) + spec.shard_servers()[1:]:
        link = dist.new_group([0, peer], timeout=timeout, backend="gloo")
        if env.rank in (0, peer):
            links[peer] = link
    shards = None
    if spec.owner_rounds:
        # Who talks to the owners: every worker (its chunk of its group's vector, or its own
        # rows). Rank 0's links to the leaders and a sharded group's workers carry shard 0
        # too: made above. With one shard (a sharded group's rounds) rank 0 owns it all.
        senders = list(range(1, spec.n_workers + 1))
        reuse = {(0, rank): links.get(rank) for rank in linked_ranks(spec)}
        shards = shard_links(spec.shard_servers(), senders, env.rank, timeout, reuse)
    ring_links: dict[frozenset[int], dist.ProcessGroup] = {}
    cross = None
    if spec.sync_strategy == "sync":
        cross = leader_ring(spec.leader_ranks(), env.rank, ring_links, timeout)
    topo = Topology(
        rank=env.rank,
        world_size=env.world_size,
        n_workers=spec.n_workers,
        group_index=my_index,
        group=my_group,
        group_ranks=tuple(spec.group_ranks(my_index)) if my_index is not None else (),
        device=device,
        links=links,
        cross=cross,
        ring_links=ring_links,
        control=control,
        groups=tuple(tuple(spec.group_ranks(g)) for g in range(len(spec.groups))),
        timeout=timeout,
        shards=shards,
    )
    # Every rank has finished making every group before any goes on: a rank that fails right
    # after (say in the user's build_model) cannot break a peer's group set-up, so each rank
    # fails on the user's error itself and its output shows that error.
    barrier(topo)
    return topo


def add_ring_links(
    members: list[int],
    rank: int,
    links: dict[frozenset[int], dist.ProcessGroup],
    timeout: timedelta,
) -> None:
    """Make the two-rank gloo groups a ring of ``members`` (global ranks, in ring order)
    lacks from ``links``, and add them (a pair without this ``rank`` maps to torch's
    non-member marker, so that every rank knows which are made). Every rank of the task calls
    it alike, in the same order (each group is made by all of them): the process groups'
    rule."""
    for pair in ring_pairs(members):
        if pair not in links:
            links[pair] = dist.new_group(sorted(pair), timeout=timeout, backend="gloo")


def leader_ring(
    members: list[int],
    rank: int,
    links: dict[frozenset[int], dist.ProcessGroup],
    timeout: timedelta,
) -> LeaderRing | None:
    """The ring of ``members`` (global ranks, in ring order) as this ``rank`` takes part in
    it, once :func:`add_ring_links` has made the links it lacks (every rank of the task calls
    it alike); None for a rank outside it, or fewer than two members."""
    add_ring_links(members, rank, links, timeout)
    if len(members) < 2 or rank not in members:
        return None
    return LeaderRing(members, rank, links, timeout)


@dataclass(frozen=True)
class ShardLinks:
    """The links of a parameter server in ``S`` shards, as this rank takes part in them.

    Shard ``s`` of every exchanged vector is owned by global rank ``servers[s]``, which sums
    the group leaders' slices of it and answers each leader with its slice of the result
    (a sharded parameter server, after BytePS, Jiang et al., OSDI 2020: each server's link
    carries 1/S of every leader's bytes). ``leaders``: the ranks that exchange with the
    owners: every compute worker (each its part of its group's vector,
    :mod:`worker.engine.shard_server`). ``links`` holds the
    two-rank gloo group of each (server, leader) pair that includes ``rank``, keyed by that
    pair; made by :func:`shard_links`.
    """

    servers: tuple[int, ...]
    leaders: tuple[int, ...]
    rank: int
    links: Mapping[tuple[int, int], dist.ProcessGroup]

    @property
    def shard(self) -> int | None:
        """This rank's shard index, None on a rank that owns no shard."""
        return self.servers.index(self.rank) if self.rank in self.servers else None

    def link(self, server: int, leader: int) -> dist.ProcessGroup:
        """The two-rank group of ``server`` and ``leader`` (global ranks). Raises KeyError for a
        pair this rank is not in, or that has no link."""
        return self.links[(server, leader)]


def shard_links(
    servers: list[int],
    leaders: list[int],
    rank: int,
    timeout: timedelta,
    existing: Mapping[tuple[int, int], dist.ProcessGroup | None] | None = None,
) -> ShardLinks:
    """Make a two-rank gloo group for every (server, leader) pair, servers in order, each
    server's leaders in order, and return this ``rank``'s part (:class:`ShardLinks`). A pair
    that is a key of ``existing`` (say the parameter server's link to a leader) was made
    already and is not made again: its value is the group on the pair's ranks, None (or
    anything) on the others; it must be a key on every rank alike.

    Every rank of the world calls it alike, members or not (torch.distributed's rule for
    making groups). Raises ValueError when ``servers`` and ``leaders`` share a rank or
    repeat one.
    """
    if set(servers) & set(leaders):
        raise ValueError(f"servers {servers} and leaders {leaders} must not share a rank")
    if len(set(servers)) != len(servers) or len(set(leaders)) != len(leaders):
        raise ValueError(f"a rank is repeated in servers {servers} or leaders {leaders}")
    mine: dict[tuple[int, int], dist.ProcessGroup] = {}
    for server in servers:
        for leader in leaders:
            pair = (server, leader)
            if existing is not None and pair in existing:
                group = existing[pair]
            else:
                group = dist.new_group([server, leader], timeout=timeout, backend="gloo")
            if rank in pair:
                assert group is not None, f"no group for {pair} on one of its ranks"
                mine[pair] = group
    return ShardLinks(tuple(servers), tuple(leaders), rank, mine)


def linked_ranks(spec: RunSpec) -> list[int]:
    """The workers with a link to the parameter server (:attr:`Topology.links`), in rank
    order: every group leader and every worker of a sharded group."""
    linked = set(spec.leader_ranks())
    for index in range(len(spec.groups)):
        if spec.sharded(index):
            linked.update(spec.group_ranks(index))
    return sorted(linked)


# Process groups (docs/architecture.md, "Process groups"). The world group carries nothing:
# gloo would connect every pair of its ranks, world (world - 1) / 2 connections, so it is made
# with lazy connections and never used, and opens none. Every message goes through a group
# whose ranks talk: each resource group (W_g (W_g - 1) / 2 connections), a link between the
# parameter server and each group leader (G connections, a star: a group of the server and
# every leader would connect the leaders among themselves too, G (G + 1) / 2), a link to each
# worker of a sharded group, under sync a ring of links among the leaders (G connections,
# one for two leaders; ``cross``, worker/engine/ring.py, whose ring allreduce carries the
# step's sum: a leaders' group would connect every pair of them, G (G - 1) / 2; a parked
# group's neighbours get a link of their own, kept for the run) and, when the guard takes a
# parked group back, its workers with the worker they copy (``worker.engine.run.refresh``);
# with the parameter server's owners (``RunSpec.owner_rounds``: ``ps_shards`` > 1, or a
# sharded group under periodic or diloco) a link between every owner and every worker.
# These are connected when
# made: gloo's lazy connections abort a rank in torch 2.13 when a connected peer exits first
# ("pair.cc:676 state_ <= CONNECTED. 5 vs 4", an assertion on gloo's event-loop thread), so
# the world group, which never connects, is the only lazy one.
#
# Control collectives: small tensors and objects every rank of the task takes part in (the
# balancer's table, validation sums, the data's item counts, checkpoint outlines). Each goes
# through the rank's resource group (``control``, gloo's collectives) and, between the
# groups, through the parameter server: each leader sends its group's part to rank 0 and
# takes the result back (point to point on its link, under :data:`CONTROL_TAG`). Every rank
# of the task calls each one, in the same order, as it would the world's, but the owners of
# the parameter server's other shards (``ps_shards``), which take part in none. The parameter
# server's part is 2 G small messages a collective.

CONTROL_TAG = 1 << 30
"""The gloo tag of the control messages between the parameter server and the leaders: apart
from the exchange's piece tags (worker/engine/exchange.py), which may be in flight at the
same time under the overlapped exchange."""


def in_group_control(topo: Topology) -> dist.ProcessGroup | None:
    """This rank's control group (gloo) when its resource group has more than one member,
    else None: the first and last stage of a sum over several groups."""
    return topo.control if len(topo.group_ranks) > 1 else None


def leader_ranks(topo: Topology) -> list[int]:
    """Global ranks of the group leaders, in group order."""
    return [ranks[0] for ranks in topo.groups]


def _send_tensor(tensor: torch.Tensor, dst: int, topo: Topology) -> None:
    dist.send(tensor, dst=dst, group=topo.link(dst), tag=CONTROL_TAG)


def _recv_tensor(tensor: torch.Tensor, src: int, topo: Topology) -> torch.Tensor:
    dist.recv(tensor, src=src, group=topo.link(src), tag=CONTROL_TAG)
    return tensor


class Arrivals:
    """Messages from several peers, each over its own link to this rank (:meth:`Topology.link`),
    taken in the order they arrive: MPI's receive from any source, which torch.distributed
    offers only inside one process group, where gloo connects every pair of its ranks.

    Each expected message has its own receive and a thread that waits on it (gloo's
    receive works do not say they are done until waited on), which hands it over on
    arrival. A peer with a message expected must send it within the process groups'
    timeout (:attr:`Topology.timeout`) from when it is expected, as a blocking exchange's
    must; else the receive fails and :meth:`take` raises its error.
    """

    def __init__(self, topo: Topology, tag: int = 0) -> None:
        self.topo, self.tag = topo, tag
        self._arrived: queue.SimpleQueue[tuple[int, torch.Tensor, BaseException | None]]
        self._arrived = queue.SimpleQueue()
        self.waiting: set[int] = set()

    def expect(self, peer: int, buffer: torch.Tensor) -> None:
        """Start receiving ``buffer`` (CPU, contiguous; left alone until :meth:`take` hands
        it back) from global rank ``peer``. Raises RuntimeError when a message from ``peer``
        is already expected."""
        if peer in self.waiting:
            raise RuntimeError(f"a message from rank {peer} is already expected")
        work = dist.irecv(buffer, src=peer, group=self.topo.link(peer), tag=self.tag)
        assert work is not None  # None only outside the group
        self.waiting.add(peer)

        def wait() -> None:
            try:
                work.wait(self.topo.timeout)
            except BaseException as exc:  # noqa: BLE001 (handed to the taker, raised there)
                self._arrived.put((peer, buffer, exc))
            else:
                self._arrived.put((peer, buffer, None))

        threading.Thread(target=wait, name=f"arrival-from-{peer}", daemon=True).start()

    def take(self) -> tuple[int, torch.Tensor]:
        """The next message to arrive: its sender's global rank and the buffer it filled.
        Raises RuntimeError when none is expected, or what its receive raised."""
        if not self.waiting:
            raise RuntimeError("no message is expected")
        peer, buffer, error = self._arrived.get()
        self.waiting.discard(peer)
        if error is not None:
            raise error
        return peer, buffer


def send_object(obj: Any, dst: int, topo: Topology) -> None:
    """Send picklable ``obj`` to global rank ``dst`` over this rank's link to it (its size,
    then its bytes, under the control tag)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    _send_tensor(torch.tensor([data.numel()], dtype=torch.int64), dst, topo)
    _send_tensor(data, dst, topo)


def recv_object(src: int, topo: Topology) -> Any:
    """What :func:`send_object` sent from global rank ``src`` (within the process groups'
    timeout)."""
    size = int(_recv_tensor(torch.empty(1, dtype=torch.int64), src, topo))
    data = _recv_tensor(torch.empty(size, dtype=torch.uint8), src, topo)
    return pickle.loads(data.numpy().tobytes())  # noqa: S301 (from a rank of this task)


def _sum_at_ps(tensor: torch.Tensor, topo: Topology) -> None:
    """The leaders' and the parameter server's ``tensor`` summed in place on each of them
    (the server adds the leaders' parts in group order and sends the sum back)."""
    if topo.is_ps:
        part = torch.empty_like(tensor)
        for leader in leader_ranks(topo):
            tensor += _recv_tensor(part, leader, topo)
        for leader in leader_ranks(topo):
            _send_tensor(tensor, leader, topo)
    elif topo.am_i_leader:
        _send_tensor(tensor, 0, topo)
        _recv_tensor(tensor, 0, topo)


def barrier(topo: Topology) -> None:
    """Return once every rank of the task has called it: each resource group, then the
    leaders with the parameter server, then each group again."""
    inner = in_group_control(topo)
    if inner is not None:
        dist.barrier(group=inner)
    _sum_at_ps(torch.zeros(1), topo)
    if inner is not None:
        dist.barrier(group=inner)


def all_reduce_sum(tensor: torch.Tensor, topo: Topology) -> torch.Tensor:
    """Sum the CPU ``tensor`` (any shape) over every rank of the task, in place; returns it.

    Each group reduces to its leader, the parameter server sums the leaders' parts, and each
    leader broadcasts the sum to its group. The order of the additions differs from a world
    allreduce's: float64 sums of a few values agree to rounding; sums in which each rank
    fills its own entries and the others zeros are exact.
    """
    inner = in_group_control(topo)
    if inner is not None:
        dist.reduce(tensor, dst=topo.group_ranks[0], op=dist.ReduceOp.SUM, group=inner)
    _sum_at_ps(tensor, topo)
    if inner is not None:
        dist.broadcast(tensor, src=topo.group_ranks[0], group=inner)
    return tensor


def broadcast_object(obj: Any, topo: Topology, src: int = 0) -> Any:
    """A picklable object from global rank ``src`` to every rank of the task (``obj`` is
    ignored elsewhere): within ``src``'s group to its leader, from there to the parameter
    server, from the server to the other leaders, then within each other group."""
    box = [obj]
    home = next((g for g, ranks in enumerate(topo.groups) if src in ranks), None)
    inner = in_group_control(topo)
    if home is not None and home == topo.group_index and inner is not None:
        dist.broadcast_object_list(box, src=src, group=inner)
    root = 0 if home is None else topo.groups[home][0]
    if topo.is_ps:
        if root != 0:
            box[0] = recv_object(root, topo)
        for leader in leader_ranks(topo):
            if leader != root:
                send_object(box[0], leader, topo)
    elif topo.am_i_leader:
        if topo.rank == root:
            send_object(box[0], 0, topo)
        else:
            box[0] = recv_object(0, topo)
    if inner is not None and topo.group_index != home:
        dist.broadcast_object_list(box, src=topo.group_ranks[0], group=inner)
    return box[0]


def gather_objects(obj: Any, topo: Topology) -> list[Any] | None:
    """Every rank's picklable ``obj`` at the parameter server, as a list indexed by global
    rank; None on every other rank. Each group gathers at its leader, then each leader sends
    its group's to the parameter server."""
    inner = in_group_control(topo)
    mine: list[tuple[int, Any]] = [(topo.rank, obj)]
    if inner is not None:
        got: list[Any] | None = [None] * len(topo.group_ranks) if topo.am_i_leader else None
        dist.gather_object(mine, got, dst=topo.group_ranks[0], group=inner)
        if got is None:
            return None
        mine = [pair for part in got for pair in part]
    if topo.am_i_leader:
        send_object(mine, 0, topo)
    if not topo.is_ps:
        return None
    out: list[Any] = [None] * topo.world_size
    out[0] = obj
    for leader in leader_ranks(topo):
        for rank, value in recv_object(leader, topo):
            out[rank] = value
    return out


def all_gather_objects(obj: Any, topo: Topology) -> list[Any]:
    """Every rank's picklable ``obj`` on every rank, as a list indexed by global rank
    (:func:`gather_objects` at the parameter server, then :func:`broadcast_object`)."""
    return broadcast_object(gather_objects(obj, topo), topo, src=0)


def destroy() -> None:
    """Leave the world if joined; a no-op otherwise."""
    if dist.is_initialized():
        dist.destroy_process_group()
