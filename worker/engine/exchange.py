"""The hierarchical gradient/parameter exchange between workers and the parameter server.

Gradients go up: allreduce (sum) inside each resource group, then every
group leader sends its group's sum to the parameter server, which adds them.
Parameters come down: the parameter server sends to every leader, each
leader broadcasts inside its group. This is hierarchical allreduce with a
parameter server at the top (Li et al., OSDI 2014). Vectors are flat 1-D
tensors; in-group allreduces go in buckets, and the parameter server talks to
all leaders at once, point to point, in pieces that it adds as they arrive
(a star: its link carries each group's bytes once each way).

Exact averaging with unequal per-worker batches: every worker sends the *sum*
of its per-sample gradients (batch-mean gradient times its sample count) with
the count appended, so every sum along the way (in-group allreduce, leaders'
reduce, quorum aggregation) stays a sum of per-sample gradients, and the
parameter server divides once by the global count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from worker.engine.distributed import (
    CONTROL_TAG,
    Arrivals,
    ShardLinks,
    Topology,
    all_gather_objects,
    all_reduce_sum,
    gather_objects,
    leader_ranks,
)

BUCKET_BYTES = 16 * 2**20
# Point-to-point messages between the parameter server and the group leaders.
PIECE_BYTES = 4 * 2**20


def params_of(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The model's parameters, in the fixed order used for every flat vector."""
    return list(model.parameters())


def vector_to_grads(vector: Tensor, params: Iterable[torch.nn.Parameter]) -> None:
    """Set ``.grad`` of each trainable parameter from its slice of ``vector``.

    Frozen parameters (``requires_grad=False``) keep ``grad=None`` so the
    optimizer skips them, as it would in one process. The gradients are views of
    ``vector`` (no copy): the caller must not change it until the optimizer has
    stepped and the gradients were set to None.
    """
    offset = 0
    for p in params:
        n = p.numel()
        if p.requires_grad:
            p.grad = vector[offset : offset + n].view_as(p)
        offset += n


@torch.no_grad()
def load_vector_(vector: Tensor, params: Iterable[torch.nn.Parameter]) -> None:
    """Copy ``vector`` into the parameters in place (parameter identity is kept,
    unlike ``torch.nn.utils.vector_to_parameters`` which rebinds ``.data``)."""
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(vector[offset : offset + n].view_as(p))
        offset += n


def allreduce_sum(
    vector: Tensor, group: dist.ProcessGroup | None, bucket_bytes: int = BUCKET_BYTES
) -> Tensor:
    """Sum the 1-D ``vector`` in place over ``group``, in buckets of at most ``bucket_bytes``.

    Buckets are issued asynchronously and awaited together, so transfers of
    one bucket overlap the reduction of the previous. A group of one rank is
    a no-op. Returns ``vector``.
    """
    if group is None or dist.get_world_size(group) == 1:
        return vector
    per_bucket = max(1, bucket_bytes // vector.element_size())
    sum_op = dist.ReduceOp.SUM
    works = [
        dist.all_reduce(vector[i : i + per_bucket], op=sum_op, group=group, async_op=True)
        for i in range(0, vector.numel(), per_bucket)
    ]
    for work in works:
        work.wait()
    return vector


def push_up(topo: Topology, vector: Tensor) -> None:
    """Worker side of the upward sum: allreduce in the group, leader reduces to rank 0.

    ``vector`` (1-D, on ``topo.device``) is summed in place inside the group.
    """
    if topo.group is None:
        raise RuntimeError("push_up is for compute workers")
    allreduce_sum(vector, topo.group)
    leader_reduce(topo, vector)


def leader_reduce(topo: Topology, vector: Tensor) -> None:
    """Group leaders send ``vector`` (1-D) to the parameter server, which sums the groups'
    vectors (:func:`gather_at_ps`); other workers do nothing.

    Point to point, in pieces of :data:`PIECE_BYTES`, all posted at once: the
    server adds piece k while piece k + 1 is on the way.
    """
    if topo.am_i_leader:
        wait_all(post_to_ps(topo, vector.cpu()))


def post_to_ps(topo: Topology, vector: Tensor) -> list[Any]:
    """Start sending the 1-D CPU ``vector`` from this group leader to the parameter server, in
    pieces (:func:`gather_at_ps` receives them); returns the works to wait on. ``vector``
    must not change until they are done."""
    return post_pieces(vector, 0, topo.link(0))


def post_from_ps(topo: Topology, buffer: Tensor) -> list[Any]:
    """Start receiving, on a group leader, what the parameter server sends with
    :func:`broadcast_down` into the 1-D CPU ``buffer``; returns the works to wait on."""
    return receive_pieces(buffer, 0, topo.link(0))


def expect_at_ps(arrivals: Arrivals, leader: int, numel: int, dtype: torch.dtype) -> None:
    """Parameter server: start receiving the first piece of the next vector [numel] that
    the group leader of global rank ``leader`` sends with :func:`post_to_ps`, among
    ``arrivals`` (tag 0, the first piece's; :func:`receive_any_at_ps` takes it)."""
    first, last = pieces(numel, torch.empty(0, dtype=dtype).element_size())[0]
    arrivals.expect(leader, torch.empty(last - first, dtype=dtype))


def receive_any_at_ps(topo: Topology, buffer: Tensor, arrivals: Arrivals) -> int:
    """Parameter server: receive into the 1-D CPU ``buffer`` the next vector a group leader
    sent with :func:`post_to_ps`, whichever expected leader's (:func:`expect_at_ps`) comes
    first; returns that leader's global rank. The first piece is the one ``arrivals``
    received, the rest come from its sender."""
    parts = pieces(buffer.numel(), buffer.element_size())
    first, last = parts[0]
    sender, piece = arrivals.take()
    buffer[first:last].copy_(piece)
    link = topo.link(sender)
    wait_all(
        [
            dist.irecv(buffer[a:b], src=sender, group=link, tag=k)
            for k, (a, b) in enumerate(parts)
            if k > 0
        ]
    )
    return sender


def post_to_leader(topo: Topology, vector: Tensor, leader: int) -> list[Any]:
    """Parameter server: start sending the 1-D CPU ``vector`` to the group leader of global
    rank ``leader`` alone (:func:`post_from_ps` receives it); returns the works to wait on.
    ``vector`` must not change until they are done."""
    return post_pieces(vector, leader, topo.link(leader))


def gather_at_ps(
    topo: Topology, numel: int, dtype: torch.dtype, leaders: list[int] | None = None
) -> Tensor:
    """Parameter-server side of the upward sum: returns the sum over all workers, shape [numel]
    (over the groups of ``leaders``, global ranks, when given: the others are parked).

    Receives every group leader's vector at once (point to point, in pieces)
    and adds them in leader order, piece by piece as they arrive: the server's
    link carries each group's bytes once, where a reduce collective would also
    pass partial sums around a ring through the leaders. The order of the
    additions is fixed, so the result does not depend on arrival order.
    """
    leaders = leader_ranks(topo) if leaders is None else leaders
    return sum_received([(rank, topo.link(rank)) for rank in leaders], numel, dtype)


def sum_received(
    sources: list[tuple[int, dist.ProcessGroup]],
    numel: int,
    dtype: torch.dtype,
    timeout: timedelta | None = None,
) -> Tensor:
    """The sum, shape [numel], of the 1-D vectors that each ``(global rank, link)`` of
    ``sources`` sends (with :func:`post_pieces`): every receive posted at once, the pieces
    added in the order of ``sources`` as each piece has arrived from all of them (each
    waited for up to ``timeout``, default the links' own)."""
    total = torch.empty(numel, dtype=dtype)
    spare = [_scratch(i, numel, dtype) for i in range(len(sources) - 1)]
    parts = pieces(numel, total.element_size())
    received = [
        [dist.irecv(buffer[a:b], src=rank, group=link, tag=k) for k, (a, b) in enumerate(parts)]
        for (rank, link), buffer in zip(sources, [total, *spare], strict=True)
    ]
    for k, (a, b) in enumerate(parts):
        wait_all([works[k] for works in received], timeout)
        for buffer in spare:
            total[a:b] += buffer[a:b]
    return total


def post_pieces(vector: Tensor, peer: int, link: dist.ProcessGroup) -> list[Any]:
    """Start sending the 1-D CPU ``vector`` to global rank ``peer`` over ``link``, in pieces of
    :data:`PIECE_BYTES` tagged by their index; returns the works. ``vector`` must not change
    until they are done."""
    return [
        dist.isend(vector[a:b], dst=peer, group=link, tag=k)
        for k, (a, b) in enumerate(pieces(vector.numel(), vector.element_size()))
    ]


def receive_pieces(buffer: Tensor, peer: int, link: dist.ProcessGroup) -> list[Any]:
    """Start receiving into the 1-D CPU ``buffer`` what global rank ``peer`` sends with
    :func:`post_pieces` over ``link``; returns the works."""
    return [
        dist.irecv(buffer[a:b], src=peer, group=link, tag=k)
        for k, (a, b) in enumerate(pieces(buffer.numel(), buffer.element_size()))
    ]


def shard_bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``shards`` contiguous slices of a flat vector [numel], as
    equal as they can be (the first ``numel % shards`` one element longer). Raises ValueError
    for ``shards`` < 1 or more shards than elements."""
    if shards < 1 or shards > max(numel, 1):
        raise ValueError(f"cannot cut {numel} elements into {shards} shards")
    return chunks(numel, shards)


def chunks(numel: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``parts`` contiguous parts of a vector [numel], in order, as
    equal as they can be (the first ``numel % parts`` one element longer; empty ones when
    there are more parts than elements: a group's members' chunks)."""
    size, extra = divmod(numel, parts)
    bounds, start = [], 0
    for s in range(parts):
        end = start + size + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def sharded_round(shards: ShardLinks, slices: list[Tensor], outs: list[Tensor]) -> None:
    """Group leader's side of a round with a sharded parameter server: send ``slices[s]``
    (1-D, CPU) to the owner of shard ``s`` and receive its answer into ``outs[s]`` (1-D, CPU),
    every shard at once; returns when all are done. The servers run :func:`serve_shard`.

    Raises ValueError unless there is one slice and one answer buffer per shard.
    """
    sends, receives = post_round(shards, slices, outs)
    wait_all(sends + receives)


def post_round(
    shards: ShardLinks, slices: list[Tensor], outs: list[Tensor]
) -> tuple[list[Any], list[Any]]:
    """Start :func:`sharded_round` without waiting: returns its sends' and its receives'
    works. ``slices`` must not change until the sends are done, nor ``outs`` be read until
    the receives are. Raises ValueError unless there is one slice and one answer buffer per
    shard."""
    if not len(slices) == len(outs) == len(shards.servers):
        raise ValueError(
            f"{len(slices)} slices and {len(outs)} answers for {len(shards.servers)} shards"
        )
    sends: list[Any] = []
    receives: list[Any] = []
    for server, piece, out in zip(shards.servers, slices, outs, strict=True):
        link = shards.link(server, shards.rank)
        sends += post_pieces(piece.contiguous(), server, link)
        receives += receive_pieces(out, server, link)
    return sends, receives


def serve_shard(
    shards: ShardLinks,
    numel: int,
    dtype: torch.dtype,
    answer: Callable[[Tensor], Tensor],
    leaders: list[int] | None = None,
) -> Tensor:
    """Shard owner's side of :func:`sharded_round`: sum the [numel] slices the group leaders
    send (``leaders``, global ranks; by default every rank ``shards`` links to an owner,
    :attr:`worker.engine.distributed.ShardLinks.leaders`), in
    leader order (:func:`sum_received`), and send ``answer(sum)`` (1-D, CPU) back to each of
    them; returns that answer. Waits as long as the leaders take to come, up to
    :data:`STATUS_WAIT` (their steps or their round, or rank 0's checkpoint before they
    come); a peer that is gone fails it at once. Raises ValueError on a rank that owns no
    shard."""
    if shards.shard is None:
        raise ValueError(f"rank {shards.rank} owns no shard")
    to = list(shards.leaders) if leaders is None else leaders
    sources = [(leader, shards.link(shards.rank, leader)) for leader in to]
    total = sum_received(sources, numel, dtype, STATUS_WAIT)
    result = answer(total).contiguous()
    wait_all(
        [w for leader, link in sources for w in post_pieces(result, leader, link)], STATUS_WAIT
    )
    return result


def broadcast_down(topo: Topology, vector: Tensor, leaders: list[int] | None = None) -> Tensor:
    """Send ``vector`` from the parameter server to every worker; returns the received tensor.
    ``leaders`` (parameter server): the groups to send to, by their leaders' global ranks,
    when not every group (the others are parked).

    On rank 0 ``vector`` is the payload (CPU); elsewhere it gives shape and dtype
    and, when it is on ``topo.device``, is the buffer the result is received into
    (a CPU buffer is received into in place; else the result is a new tensor). The
    result lives on ``topo.device``. The server
    sends to every leader at once (point to point, in pieces); each leader
    then broadcasts inside its group.
    """
    if topo.is_ps:
        payload = vector.contiguous()
        to = leader_ranks(topo) if leaders is None else leaders
        wait_all([w for rank in to for w in post_to_leader(topo, payload, rank)])
        return vector
    assert topo.group is not None and topo.leader_rank is not None
    received = vector.to(topo.device)
    if topo.am_i_leader:
        in_place = received.device.type == "cpu" and received.is_contiguous()
        on_cpu = received if in_place else torch.empty(vector.numel(), dtype=vector.dtype)
        wait_all(post_from_ps(topo, on_cpu))
        received = on_cpu.to(topo.device)
    return group_broadcast(topo, received)


def group_broadcast(topo: Topology, tensor: Tensor) -> Tensor:
    """The group leader's ``tensor`` (on ``topo.device``) on every member of its group, in
    place; returns it."""
    if len(topo.group_ranks) > 1:
        dist.broadcast(tensor, src=topo.leader_rank, group=topo.group)
    return tensor


def send_to_ps(topo: Topology, vector: Tensor) -> None:
    """Send the 1-D ``vector`` from this group leader to the parameter server (point to point
    over its link, on CPU); the server receives it with :func:`receive_at_ps`."""
    dist.send(vector.detach().cpu().contiguous(), dst=0, group=topo.link(0))


def receive_at_ps(topo: Topology, numel: int, dtype: torch.dtype, src: int) -> Tensor:
    """Parameter server: the vector [numel] that leader ``src`` (global rank) sends it."""
    buffer = torch.empty(numel, dtype=dtype)
    dist.recv(buffer, src=src, group=topo.link(src))
    return buffer


def send_status(topo: Topology, reason: str | None) -> None:
    """From a group leader to the parameter server: all is well (``reason`` None) or a
    failure's reason (point to point over its link, under :data:`STATUS_TAG`, read by
    :func:`receive_status`). Waits as long as the server takes to read it, up to
    :data:`STATUS_WAIT` (it may be writing a checkpoint); a server that is gone fails it."""
    flag = torch.tensor([0.0 if reason is None else 1.0])
    work = dist.isend(flag, dst=0, group=topo.link(0), tag=STATUS_TAG)
    assert work is not None
    work.wait(STATUS_WAIT)
    if reason is not None:
        dist.send_object_list([reason], dst=0, group=topo.link(0))


# How long the parameter server waits for the workers between two meeting points.
STATUS_WAIT = timedelta(days=7)
# The statuses' tag: apart from the pieces' (0, 1, ...) on the same link, so a status can
# never be taken for a piece of a vector, nor a piece for a status.
STATUS_TAG = CONTROL_TAG + 1


def receive_status(topo: Topology, src: int) -> str | None:
    """Parameter server: the status leader ``src`` (global rank) sends, None when all is well.

    Waits as long as the workers take to get there, up to :data:`STATUS_WAIT`: an epoch
    without a control point may last longer than the process groups' timeout, which a plain
    receive applies. A peer that is gone still fails the receive at once (its connection
    closes). Raises what the receive raises.
    """
    flag = torch.zeros(1)
    work = dist.irecv(flag, src=src, group=topo.link(src), tag=STATUS_TAG)
    assert work is not None  # None only for a rank outside the group
    work.wait(STATUS_WAIT)
    if float(flag) == 0.0:
        return None
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=topo.link(src))
    return str(box[0])


def pieces(numel: int, element_size: int, piece_bytes: int | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` element ranges of at most ``piece_bytes`` (default :data:`PIECE_BYTES`)."""
    per = max(1, (piece_bytes or PIECE_BYTES) // element_size)
    return [(a, min(a + per, numel)) for a in range(0, numel, per)]


def wait_all(works: list[Any], timeout: timedelta | None = None) -> None:
    """Wait for point-to-point works, each bounded by ``timeout`` (default: its process
    group's timeout); a peer that is gone fails the wait at once."""
    for work in works:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)


_SCRATCH: dict[tuple[int, int, torch.dtype], Tensor] = {}


def _scratch(index: int, numel: int, dtype: torch.dtype) -> Tensor:
    """A reusable receive buffer of the parameter server (kept: a round allocates nothing)."""
    key = (index, numel, dtype)
    if key not in _SCRATCH:
        if len(_SCRATCH) >= 8:
            _SCRATCH.clear()
        _SCRATCH[key] = torch.empty(numel, dtype=dtype)
    return _SCRATCH[key]


def sum_over_world(
    totals: dict[str, tuple[float, float]], topo: Topology
) -> dict[str, tuple[float, float]]:
    """Sum ``name -> (weighted_sum, count)`` pairs over every rank of the task.

    Ranks may hold different names (a worker with no validation samples holds
    none); names are first united (:func:`worker.engine.distributed.all_gather_objects`),
    then the values are summed by one float64 sum (``all_reduce_sum``), both through the
    groups and the leaders.
    """
    names_per_rank = all_gather_objects(sorted(totals), topo)
    names = sorted({n for rank_names in names_per_rank for n in rank_names or []})
    flat = torch.zeros(2 * len(names), dtype=torch.float64)
    for i, name in enumerate(names):
        flat[2 * i], flat[2 * i + 1] = totals.get(name, (0.0, 0.0))
    all_reduce_sum(flat, topo)
    return {name: (float(flat[2 * i]), float(flat[2 * i + 1])) for i, name in enumerate(names)}


def gather_work(
    topo: Topology, compute_s: float, samples: float, *more: float
) -> tuple[list[float], ...]:
    """Every worker's ``(compute seconds, samples, *more)`` on every rank, as one list over
    workers for each.

    One float64 sum over the task (``all_reduce_sum``: through the groups and the leaders)
    of a ``[2 + len(more), W]`` tensor in which each worker fills its own column (the
    parameter server contributes zeros), so the sum is exact.
    """
    values = [compute_s, samples, *more]
    table = torch.zeros(len(values), topo.n_workers, dtype=torch.float64)
    if not topo.is_ps:
        table[:, topo.worker_index] = torch.tensor(values, dtype=torch.float64)
    all_reduce_sum(table, topo)
    return tuple(row.tolist() for row in table)


def gather_worker_states(
    topo: Topology, optimizer_outline: dict[str, Any] | None
) -> dict[int, dict[str, Any]] | None:
    """Collect every compute worker's RNG state (and the outline of the optimizer state it
    wrote into a state folder, ``worker.engine.fsdp.save_state``) at rank 0
    (:func:`worker.engine.distributed.gather_objects`).

    Call on every rank of the task; returns ``{rank: {"rng", "optimizer"}}`` on rank 0 (the
    optimizer an outline, or None for a rank that wrote none) and None elsewhere. No state
    tensor travels: those who hold them wrote them beside the checkpoint.
    """
    mine = None
    if not topo.is_ps:
        mine = {"rng": torch.get_rng_state(), "optimizer": optimizer_outline}
    gathered = gather_objects(mine, topo)
    if gathered is None:
        return None
    return {r: state for r, state in enumerate(gathered) if state is not None}
