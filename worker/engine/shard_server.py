"""The parameter server in S shards (``RunSpec.ps_shards`` > 1, or S = 1 for a sharded group's
rounds: ``RunSpec.owner_rounds``): what rank 0, the other shard owners and the workers (each its
part of its group's vector) say to each other, for ``periodic`` model averaging, ``diloco``'s
outer optimizer (its ``blocking`` and ``overlapped`` exchanges) and ``sync``'s gradient sum.

The P parameters are cut into S contiguous slices (:func:`worker.engine.exchange.shard_bounds`);
slice s is owned by ``RunSpec.shard_servers()[s]``: rank 0 for slice 0, then the ranks after
the last compute worker, which build no model and train nothing (:func:`serve`). A group's
round vector is ``[params part (P), rest]`` (the unsharded round's layout: ``periodic``
``[n_g theta_g, buffer changes, loss, n_g]``, ``diloco`` ``[n_g Delta_g / tau_g, buffer
changes, loss, n_g tau_g, n_g]``), alike on every member of the group. At a round's end:

1. rank 0 tells every other owner which groups take part (the guard's parked groups left out);
2. each member m of a taking group of W sends its chunk m of the params part
   (:func:`worker.engine.exchange.chunks`; a sharded group's member its own rows of the
   params, :func:`member_parts`, and takes back its rows of the new model, gathering
   nothing), slice s of the chunk to slice s's owner with the
   round's counts appended (``n_g``; under ``diloco`` ``n_g tau_g, n_g``), and its part of
   slice 0 with all of ``rest`` to rank 0, and takes every owner's answer back; the members
   then gather their chunks of the new model (:class:`SliceExchange`);
3. each owner assembles each group's part of its slice from the members, adds the groups in
   group order (:func:`serve_parts`) and answers every member with its part of the
   new global model, rank 0 the buffers too: ``periodic`` the sample-weighted
   mean (:data:`MEAN`), ``diloco`` one step of the outer SGD with Nesterov momentum on the
   FedNova update ``tau_eff / n * sum_g n_g Delta_g / tau_g`` (:data:`OUTER`), each owner
   keeping the outer optimizer's momentum of its own slice.

Every element is the same sum in the same order, and the same update, as the unsharded
server's, so a run is bitwise the one-server run. Each owner's link carries G / S of the
groups' bytes each way where one server's carried all of them (BytePS, Jiang et al., OSDI
2020). Rank 0 sends each owner its slice of the global model, and of a resumed outer
momentum, when an attempt starts training (:data:`LOAD`), then keeps slice 0 only (with one
shard all of it, once, not the model's parameters beside), and for each checkpoint tells
every owner to write its slice of the model and of the outer momentum into a state folder of
its own (:data:`WRITE`, :func:`write_slice`), so no process gathers the model. It sends
:data:`STOP` at the end. A command waits as long
as an epoch's end takes (:data:`exchange.STATUS_WAIT`); a rank that is gone fails it at once.

Under ``sync`` the owners are a summation service (BytePS's, Jiang et al., OSDI 2020): each
step of two or more stepping groups, member m of each stepping group of W sends its chunk m
of the group's step vector ``[count * grad (P), buffer changes (B), loss, count]`` (cut in
S slices over all of it) to the slices' owners and takes the chunk back summed over the
groups, in group order; the members then gather their chunks (:class:`OwnerSum`, in place
of the leaders' ring allreduce and the leader's broadcast: on a CPU group each piece goes as
soon as backward, and the group's sum, have made it final; elsewhere at the end). Each owner
assembles the groups' parts from their members (:class:`RowSum`); rank 0 commands each step
and sums slice 0 (:func:`sum_round`, :data:`SUM`). With a sharded (``fsdp``) group every
worker of it sends its own rows instead, every step (:func:`rows_over_owners`). The owners
keep no state: every worker still steps its own replica of the user's optimizer (or its
shard of it) from the global sum, so the optimizer's state is the workers' as without
shards. Each element is summed in the same order whatever
S, so runs with S = 2 and S = 3 are bitwise alike; against the ring (S = 1) they differ in
the sum's rounding only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from contracts import sharded_state
from worker.engine import report
from worker.engine.distributed import CONTROL_TAG, ShardLinks, Topology, recv_object, send_object
from worker.engine.exchange import (
    STATUS_WAIT,
    chunks,
    pieces,
    post_pieces,
    receive_pieces,
    shard_bounds,
    wait_all,
)
from worker.engine.fsdp import like, row_layout, save_folder
from worker.engine.sharded import local
from worker.engine.spec import RunSpec
from worker.engine.state import ModelState

STOP, LOAD, MEAN, OUTER, SUM, LAYOUT, WRITE = 0, 1, 2, 3, 5, 6, 7
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# LOAD's flags: the outer momentum's slice follows the parameters', then the trainable mask's.
WITH_MOMENTUM, WITH_MASK = 1, 2
# The round's counts each slice carries: periodic n_g; diloco n_g tau_g and n_g.
COUNTS = {"periodic": 1, "diloco": 2}


def round_dtype(strategy: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the rounds' vectors for a model of ``dtype``: the model's under
    ``periodic``, at least float32 under ``diloco`` (its round totals, ``n_g tau_g``, pass
    float16's range: :func:`worker.engine.strategy_diloco.exchange_dtype`)."""
    return dtype if strategy == "periodic" else torch.promote_types(dtype, torch.float32)


def _owners(topo: Topology) -> tuple[int, ...]:
    assert topo.shards is not None, "the parameter server is not sharded"
    return topo.shards.servers


def _command(
    topo: Topology,
    op: int,
    bounds: list[tuple[int, int]],
    dtype: torch.dtype,
    leaders: list[int],
    flags: int = 0,
) -> None:
    """Rank 0: send ``[op, numel, dtype, flags, one bit per group]`` to every other owner,
    ``numel`` its slice's length (``bounds``: every shard's); a group's bit says its leader
    takes part in the round."""
    taking = set(leaders)
    groups = [1 if ranks[0] in taking else 0 for ranks in topo.groups]
    for owner, (a, b) in zip(_owners(topo)[1:], bounds[1:], strict=True):
        header = [op, b - a, dtype_code(dtype), flags, *groups]
        dist.send(torch.tensor(header, dtype=torch.int64), owner, topo.link(owner), CONTROL_TAG)


def dtype_code(dtype: torch.dtype) -> int:
    """``dtype``'s index in :data:`DTYPES`, how a command names it. Raises ValueError for a
    model whose parameters are of another dtype."""
    if dtype not in DTYPES:
        names = ", ".join(str(d) for d in DTYPES)
        raise ValueError(f"ps_shards needs parameters of {names}, not {dtype}")
    return DTYPES.index(dtype)


def write_slice(folder: Path, params: Tensor, momentum: Tensor | None) -> dict[str, Any]:
    """Write an owner's slice of the global model (``params`` [slice length], and the outer
    optimizer's ``momentum`` of it where there is some) into state folder ``folder`` with
    torch.distributed.checkpoint, on this process alone, and report each file for the
    rank's agent to upload (:func:`report.checkpoint_part`). Returns ``{"files": [...]}``,
    or ``{"error": "..."}`` where the folder could not be written (the caller names the
    shard)."""
    tensors = {"params": params.detach().cpu().contiguous()}
    if momentum is not None:
        tensors["momentum"] = momentum.detach().cpu().contiguous()
    try:
        return {"files": save_folder(tensors, folder, None)}
    except Exception as exc:  # noqa: BLE001 - told to rank 0, which fails the task with it
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def stop(topo: Topology) -> None:
    """Rank 0, when training is over: every other owner returns from :func:`serve`."""
    _command(topo, STOP, [(0, 0)] * len(_owners(topo)), torch.float32, [])


def sum_round(topo: Topology, rows: RowSum, dtype: torch.dtype, leaders: list[int]) -> None:
    """Rank 0 under ``sync``, once per step: tell every other owner that the groups of
    ``leaders`` (global ranks) send their parts of the step's vector (of ``dtype``), and sum
    slice 0 of it (``rows``, :class:`RowSum`)."""
    assert topo.shards is not None
    _command(topo, SUM, [(0, 0)] * len(_owners(topo)), dtype, leaders)
    rows.serve(topo.shards, dtype, _group_indices(topo, leaders))


def _group_indices(topo: Topology, leaders: Sequence[int]) -> list[int]:
    """The indices of the groups whose leaders are ``leaders``, in group order."""
    taking = set(leaders)
    return [g for g, ranks in enumerate(topo.groups) if ranks[0] in taking]


class OwnerSum:
    """A worker of a stepping whole group under ``sync``: its chunk of the group's step vector
    [numel] (chunk m of W, :func:`worker.engine.exchange.chunks`, the group having summed the
    vector inside it) summed over the stepping groups, each owner its slice of it
    (:func:`sum_round` and :func:`serve`), sent while backward still runs. Per step:
    :meth:`begin` with the vector
    (1-D, CPU; the answers' receives are posted), :meth:`ready` each time the elements from
    ``start`` to the end are final (the reducer's buckets complete from the end of the
    vector down: each piece goes once it is final, highest first, tagged as
    :func:`worker.engine.exchange.post_pieces` tags it), then :meth:`finish`, which sends
    what is left, waits and writes the sum into the chunk; :meth:`gather` then gives every
    member the others' chunks. The answers land in a buffer of the chunk's size (kept)."""

    def __init__(self, topo: Topology, numel: int) -> None:
        assert topo.shards is not None
        self.topo, self.shards = topo, topo.shards
        self.chunks = chunks(numel, len(topo.group_ranks))
        self.lo, self.hi = self.chunks[topo.group_ranks.index(topo.rank)]
        # This member's part of each owner's slice: [a, b) of the vector, maybe empty.
        self.parts = [
            (max(a, self.lo), min(b, self.hi))
            for a, b in shard_bounds(numel, len(self.shards.servers))
        ]
        self.answer = torch.empty(0)
        self.vector = torch.empty(0)
        # Every piece as (start, end, owner index, tag), highest first.
        self.order: list[tuple[int, int, int, int]] = []
        self.next = 0
        self.works: list[Any] = []

    def _links(self) -> list[dist.ProcessGroup]:
        me = self.shards.rank
        return [self.shards.link(owner, me) for owner in self.shards.servers]

    def begin(self, vector: Tensor) -> None:
        """Start a step whose vector is ``vector`` (its elements final only once
        :meth:`ready` says so): the answers' receives are posted."""
        if self.answer.numel() != self.hi - self.lo or self.answer.dtype != vector.dtype:
            self.answer = torch.empty(self.hi - self.lo, dtype=vector.dtype)
            size = vector.element_size()
            self.order = sorted(
                (
                    (lo + a, lo + b, s, tag)
                    for s, (lo, hi) in enumerate(self.parts)
                    if hi > lo
                    for tag, (a, b) in enumerate(pieces(hi - lo, size))
                ),
                reverse=True,
            )
        self.vector, self.next = vector, 0
        links = self._links()
        base = self.lo
        self.works = [
            w
            for (lo, hi), owner, link in zip(self.parts, self.shards.servers, links, strict=True)
            if hi > lo
            for w in receive_pieces(self.answer[lo - base : hi - base], owner, link)
        ]

    def ready(self, start: int) -> None:
        """Elements ``start`` .. the end are final: send every piece within them not yet sent."""
        links = self._links()
        while self.next < len(self.order) and self.order[self.next][0] >= start:
            a, b, s, tag = self.order[self.next]
            owner = self.shards.servers[s]
            self.works.append(dist.isend(self.vector[a:b], dst=owner, group=links[s], tag=tag))
            self.next += 1

    def finish(self) -> None:
        """Send what is left, wait for every send and answer, and write the sum into this
        member's chunk of the vector."""
        self.ready(0)
        wait_all(self.works, STATUS_WAIT)  # the owners answer once rank 0 commands the step
        self.works = []
        self.vector[self.lo : self.hi] = self.answer
        self.vector = torch.empty(0)

    def sum_whole(self, vector: Tensor) -> None:
        """:meth:`begin` to :meth:`finish` at once for a ``vector`` whose group's sum is done,
        on any device: only this member's chunk goes through the CPU."""
        on_cpu = torch.empty(vector.numel(), dtype=vector.dtype)
        on_cpu[self.lo : self.hi] = vector[self.lo : self.hi]
        self.begin(on_cpu)
        self.finish()
        vector[self.lo : self.hi] = on_cpu[self.lo : self.hi]

    def gather(self, vector: Tensor) -> None:
        """Every member's summed chunk of ``vector`` (on the group's device or the CPU) on every
        member (:func:`gather_chunks`)."""
        gather_chunks(self.topo, vector, self.chunks)


Spans = list[tuple[int, int]]


def gather_chunks(topo: Topology, vector: Tensor, spans: Spans) -> None:
    """Every member of this rank's group holds its chunk of the 1-D ``vector`` (``spans``, one
    per member in member order): each broadcasts its own, in place, so every member holds all
    of it; over the group itself when ``vector`` is on the group's device (NCCL on a CUDA
    group), else over its gloo ``control`` group. Empty chunks are skipped on every member."""
    if len(spans) == 1:
        return
    group = topo.group if vector.device == topo.device else topo.control or topo.group
    for member, (a, b) in zip(topo.group_ranks, spans, strict=True):
        if b > a:
            dist.broadcast(vector[a:b], src=member, group=group)


def member_spans(shapes: Sequence[Sequence[int]], members: int) -> list[Spans]:
    """Each of ``members`` members' spans ``[lo, hi)`` of the flat parameter vector of whole
    parameters of ``shapes`` (flat order), as FSDP2 shards them over the members (``Shard(0)``:
    :func:`worker.engine.fsdp.row_layout`), ascending, adjacent spans merged. A member's rows
    laid end to end (:meth:`worker.engine.state.ModelState.held_params`) are its spans'
    elements in order."""
    spans: list[Spans] = [[] for _ in range(members)]
    offset = 0
    for shape in shapes:
        rows, size = row_layout(torch.empty(tuple(shape), device="meta"), members)
        start = offset
        for member, count in enumerate(rows):
            if count:
                end = start + count * size
                mine = spans[member]
                if mine and mine[-1][1] == start:
                    mine[-1] = (mine[-1][0], end)
                else:
                    mine.append((start, end))
                start = end
        offset += math.prod(shape)
    return spans


@functools.lru_cache(maxsize=4)
def _member_spans(shapes: tuple[tuple[int, ...], ...], members: int) -> list[Spans]:
    """:func:`member_spans`, made once per model and group (every step reads them)."""
    return member_spans(shapes, members)


def clipped(spans: Spans, lo: int, hi: int) -> Spans:
    """``spans`` (ascending) cut to ``[lo, hi)``, relative to ``lo``; empty ones left out."""
    return [(max(a, lo) - lo, min(b, hi) - lo) for a, b in spans if min(b, hi) > max(a, lo)]


def within(spans: Spans, lo: int, hi: int) -> tuple[int, int]:
    """Where, in a vector holding ``spans``' elements end to end, those inside ``[lo, hi)``
    lie: ``[start, end)`` (contiguous, the spans being ascending)."""
    start = end = position = 0
    for a, b in spans:
        start += max(0, min(b, lo) - a)
        end += max(0, min(b, hi) - a)
        position += b - a
    return min(start, position), min(end, position)


def member_parts(
    spec: RunSpec, g: int, numel: int, shapes: Sequence[Sequence[int]]
) -> list[tuple[int, Spans]]:
    """Every member of group ``g`` (global rank, member order) with the spans it holds of a
    vector [numel] whose first elements are the parameters (``shapes``): a sharded (``fsdp``)
    group's worker its own rows of the parameters (:func:`member_spans`; numel is their
    count), a whole group's worker its chunk (:func:`worker.engine.exchange.chunks` over the
    group; no span where it is empty)."""
    ranks = spec.group_ranks(g)
    if spec.sharded(g):
        spans = _member_spans(tuple(tuple(shape) for shape in shapes), len(ranks))
        return list(zip(ranks, spans, strict=True))
    spread = chunks(numel, len(ranks))
    return [
        (rank, [span] if span[1] > span[0] else [])
        for rank, span in zip(ranks, spread, strict=True)
    ]


def senders(
    spec: RunSpec, numel: int, shapes: Sequence[Sequence[int]]
) -> list[list[tuple[int, Spans]]]:
    """Per group, in group order: who sends its part of the step's sum, a vector [numel], to
    the owners, with the spans of it each holds (:func:`member_parts`: every worker of a
    sharded group its own rows of the parameters, every worker of a whole group its chunk);
    a whole group's members whose chunk is empty left out."""
    return [
        [(rank, spans) for rank, spans in member_parts(spec, g, numel, shapes) if spans]
        for g in range(len(spec.groups))
    ]


class RowSum:
    """A shard owner's side of ``sync``'s step with the parameter server in shards: slice
    ``shard`` of the step's vector [numel] summed over the stepping groups (group order),
    each group's part of it assembled from its senders' spans (:func:`senders`: a sharded
    group's workers their rows, a whole group's their chunks), every sender answered with its
    spans of the sum. No process but a group's own holds more than its slice of its vector;
    the owner holds one slice per group. With a sharded group the vector is the gradient
    [P] (the tail is summed over the workers apart); else ``[count * grad (P), buffer changes
    (B), loss, count]``."""

    def __init__(
        self,
        spec: RunSpec,
        numel: int,
        shapes: Sequence[Sequence[int]],
        n_shards: int,
        shard: int,
    ) -> None:
        self.lo, self.hi = shard_bounds(numel, n_shards)[shard]
        self.plan = [
            [(rank, runs) for rank, spans in group if (runs := clipped(spans, self.lo, self.hi))]
            for group in senders(spec, numel, shapes)
        ]
        self.dtype: torch.dtype | None = None
        self.buffers: list[Tensor] = []

    def serve(self, shards: ShardLinks, dtype: torch.dtype, groups: Sequence[int]) -> None:
        """One step of the stepping ``groups`` (indices, the others parked): receive every
        sender's spans of this slice, sum, answer each (:func:`serve_parts`, into one part
        buffer per group kept from step to step). Waits as long as the senders take to come
        (:data:`exchange.STATUS_WAIT`)."""
        n = self.hi - self.lo
        if self.dtype != dtype:
            self.buffers = [torch.empty(n, dtype=dtype) for _ in self.plan]
            self.dtype = dtype
        plan = [self.plan[g] for g in groups]
        buffers = [self.buffers[g] for g in groups]
        serve_parts(shards, plan, n, 0, dtype, lambda total: total, buffers)


def rows_over_owners(
    grads: Sequence[Tensor | None], params: Sequence[Tensor], topo: Topology, spec: RunSpec
) -> None:
    """A compute worker's side of :class:`RowSum`: its group's part of the step's gradient
    (a sharded worker: its rows of its group's sum, FSDP2's reduce-scatter having summed
    them; a whole group: summed in the group first) sent to the owners, each owner its slice,
    and the sum over the groups taken back, set as each parameter's ``.grad`` (a sharded
    worker: its rows, no gradient ever gathered whole). ``grads``: after backward (None: not
    reached, zeros); a frozen parameter keeps none."""
    assert topo.shards is not None and topo.group_index is not None
    sharded = spec.sharded(topo.group_index)
    mine = [local(p) if sharded else p for p in params]
    parts = [
        torch.zeros(m.numel(), dtype=m.dtype, device=m.device)
        if grad is None or not p.requires_grad
        else local(grad).reshape(-1)
        for p, m, grad in zip(params, mine, grads, strict=True)
    ]
    vector = torch.cat(parts)
    members = len(topo.group_ranks)
    member = topo.group_ranks.index(topo.rank)
    shapes = tuple(tuple(p.shape) for p in params)
    numel = sum(math.prod(shape) for shape in shapes)
    if sharded:  # its rows, end to end: the flat vector's elements in its spans
        spans = _member_spans(shapes, members)[member]
        held = vector
    else:  # its chunk of the group's sum
        if members > 1:
            dist.all_reduce(vector, group=topo.group)
        spread = chunks(numel, members)
        spans = [spread[member]]
        held = vector[spread[member][0] : spread[member][1]]
    on_cpu = held.cpu()  # where its spans' elements lie end to end
    works: list[Any] = []
    sent: list[Tensor] = []
    bounds = shard_bounds(numel, len(topo.shards.servers))
    for owner, (lo, hi) in zip(topo.shards.servers, bounds, strict=True):
        a, b = within(spans, lo, hi)
        if b > a:
            link = topo.shards.link(owner, topo.rank)
            sent.append(on_cpu[a:b].clone())
            works += post_pieces(sent[-1], owner, link) + receive_pieces(on_cpu[a:b], owner, link)
    wait_all(works, STATUS_WAIT)  # the owners answer once rank 0 commands the step
    if on_cpu.data_ptr() != held.data_ptr():
        held.copy_(on_cpu)
    if not sharded:
        gather_chunks(topo, vector, spread)
    offset = 0
    for p, m in zip(params, mine, strict=True):
        n = m.numel()
        if not p.requires_grad:
            p.grad = None
        else:
            view = vector[offset : offset + n].view(m.shape)
            p.grad = like(p, view) if sharded else view  # type: ignore[arg-type]
        offset += n


def send_layout(topo: Topology, numel: int, shapes: Sequence[Sequence[int]]) -> None:
    """Rank 0: tell every other owner the length of the vector whose slices they own (under
    ``sync`` the step's, from which each builds its :class:`RowSum` with the parameters'
    ``shapes``; under ``periodic`` and ``diloco`` P and the shapes, from which each cuts the
    groups' parts, a whole group's chunks and a sharded group's rows, :func:`round_plan`)
    (:data:`LAYOUT`)."""
    shape_code = [v for shape in shapes for v in (len(shape), *shape)]
    code = torch.tensor([numel, *shape_code], dtype=torch.int64)
    for owner in _owners(topo)[1:]:
        header = [LAYOUT, code.numel(), 0, 0, *([0] * len(topo.groups))]
        link = topo.link(owner)
        dist.send(torch.tensor(header, dtype=torch.int64), owner, link, CONTROL_TAG)
        dist.send(code, owner, link, CONTROL_TAG)


def _layout(code: Tensor) -> tuple[int, list[tuple[int, ...]]]:
    """The vector's length and the shapes :func:`send_layout` encoded (``[numel, ndim, *dims,
    ...]``)."""
    values, shapes, at = code.tolist(), [], 1
    while at < len(values):
        ndim = values[at]
        shapes.append(tuple(values[at + 1 : at + 1 + ndim]))
        at += 1 + ndim
    return values[0], shapes


def round_plan(
    spec: RunSpec,
    numel: int,
    shapes: Sequence[Sequence[int]],
    lo: int,
    hi: int,
    groups: Sequence[int],
    keep_empty: bool,
) -> list[list[tuple[int, Spans]]]:
    """Who sends what of ``[lo, hi)`` of a round's parameter part [numel] (the parameters of
    ``shapes``), per group of ``groups`` (indices, group order): every member its spans
    (:func:`member_parts`: a whole group's its chunk, a sharded group's its own rows) clipped
    to the slice, relative to ``lo``; members whose spans miss the slice left out unless
    ``keep_empty`` (rank 0's slice, whose answer carries the buffers every member needs)."""
    out = []
    for g in groups:
        entries = []
        for rank, spans in member_parts(spec, g, numel, shapes):
            runs = clipped(spans, lo, hi)
            if runs or keep_empty:
                entries.append((rank, runs))
        out.append(entries)
    return out


def serve_parts(
    shards: ShardLinks,
    plan: Sequence[Sequence[tuple[int, Spans]]],
    numel: int,
    extra: int,
    dtype: torch.dtype,
    answer: Callable[[Tensor], Tensor],
    buffers: Sequence[Tensor] | None = None,
) -> Tensor:
    """An owner's side of a round or a step whose groups' members each send their runs of
    its slice [numel] (``plan``: :func:`round_plan`, or :class:`RowSum`'s) followed by
    ``extra`` elements alike on every member of a group (the round's counts; on rank 0 the
    buffers' changes too): each group's part ``[slice, extra]`` assembled from its members
    (the extra from the one received in place, else from the first: alike on all), the parts
    added in group order (the same sum, element by
    element, as one message per group would give), and every sender answered with its runs
    of ``answer(sum)`` (``[numel + k]``) followed by that answer's last ``k`` elements.
    ``buffers``: a part buffer per group of ``plan`` to assemble in (kept by the caller),
    else new ones. A single run is received in place where it has no extra or ends the
    slice (its extra then lands after it: a one-worker group's whole part), and answered
    with a view when the answer has no tail. Returns the answer. Waits as long as the
    members take to come (:data:`exchange.STATUS_WAIT`)."""
    me = shards.rank
    works: list[Any] = []
    assembled: list[tuple[Tensor, list[tuple[Spans, Tensor]], bool]] = []
    for index, group in enumerate(plan):
        part = buffers[index] if buffers is not None else torch.empty(numel + extra, dtype=dtype)
        scattered: list[tuple[Spans, Tensor]] = []
        for rank, runs in group:
            # One run is received in place: without extra, or where it ends the slice, so
            # that the extra after it in the message lands where the part keeps it.
            if len(runs) == 1 and (extra == 0 or runs[0][1] == numel):
                got = part[runs[0][0] : runs[0][1] + extra]
            else:
                got = torch.empty(sum(b - a for a, b in runs) + extra, dtype=dtype)
                scattered.append((runs, got))
            works += receive_pieces(got, rank, shards.link(me, rank))
        assembled.append((part, scattered, len(scattered) == len(group)))
    wait_all(works, STATUS_WAIT)
    total: Tensor | None = None
    for part, scattered, none_in_place in assembled:
        for runs, message in scattered:
            at = 0
            for a, b in runs:
                part[a:b] = message[at : at + b - a]
                at += b - a
        if extra and none_in_place:  # else the one in place brought it: the first one's
            part[numel:] = scattered[0][1][-extra:]
        if total is None:
            total = part
        else:
            total += part
    assert total is not None, "a round without a group"
    result = answer(total).contiguous()
    tail = result[numel:]
    answers = [  # a view for one run and no tail, else a copy kept until sent
        (
            rank,
            result[runs[0][0] : runs[0][1]]
            if len(runs) == 1 and not tail.numel()
            else torch.cat([*(result[a:b] for a, b in runs), tail]),
        )
        for group in plan
        for rank, runs in group
    ]
    wait_all(
        [w for rank, out in answers for w in post_pieces(out, rank, shards.link(me, rank))],
        STATUS_WAIT,
    )
    return result


class SliceExchange:
    """A group member's side of the sharded rounds: :meth:`post` starts sending its part of
    a round vector ``[params part, rest]``, each owner its part of the member's spans of the
    flat parameters with the round's counts appended, and rank 0 its part of slice 0 with all
    of ``rest`` (every member, so that every member gets the buffers back), and receiving
    the answers; once its receives are done, :meth:`assemble` puts slice 0's answer (its
    parameters and the buffers) in place and :meth:`gather` takes the other members' chunks.

    A whole group's member holds the whole model: its vectors' params part is the whole [P]
    and it sends its chunk of it (:func:`worker.engine.exchange.chunks` over the group); the
    answer is whole once the members gather their chunks. A sharded (``fsdp``) group's
    member holds its own rows (``rows``: :func:`member_spans`): its vectors' params part is
    those rows end to end (:meth:`worker.engine.state.ModelState.held_params`), all of it
    sent, and the answer is its rows of the new model; nothing is gathered. Every member of a
    group forms its round vector from the same model. ``counts``: how many of ``rest``'s
    last elements go with every slice (:data:`COUNTS`)."""

    def __init__(
        self, topo: Topology, n_params: int, counts: int, rows: Spans | None = None
    ) -> None:
        assert topo.shards is not None
        self.topo, self.counts = topo, counts
        self.chunks = chunks(n_params, len(topo.group_ranks))
        if rows is None:  # its chunk, at its own place in the whole model
            lo, hi = self.chunks[topo.group_ranks.index(topo.rank)]
            spans, self.start, self.n_held = [(lo, hi)], lo, n_params
        else:  # its rows, end to end
            spans, self.start = rows, 0
            self.n_held = sum(b - a for a, b in rows)
        self.gathers = rows is None
        bounds = shard_bounds(n_params, len(topo.shards.servers))
        # Where each owner's part lies in the params part of the vectors.
        self.parts = [
            (self.start + a, self.start + b)
            for a, b in (within(spans, lo, hi) for lo, hi in bounds)
        ]
        self.messages: list[Tensor] = []
        self.head = torch.empty(0)
        self.answer = torch.empty(0)

    @classmethod
    def of_member(
        cls, topo: Topology, params: Sequence[Tensor], counts: int, *, sharded: bool
    ) -> SliceExchange:
        """The exchange of this worker of a whole or (``sharded``) a sharded group, for a
        model of ``params`` (whole shapes)."""
        shapes = tuple(tuple(p.shape) for p in params)
        n_params = sum(math.prod(shape) for shape in shapes)
        if not sharded:
            return cls(topo, n_params, counts)
        member = topo.group_ranks.index(topo.rank)
        return cls(topo, n_params, counts, _member_spans(shapes, len(topo.group_ranks))[member])

    def post(self, vector: Tensor, answer: Tensor) -> tuple[list[Any], list[Any]]:
        """Start the round; returns its sends' and its receives' works. ``vector`` (1-D CPU,
        ``[params part, rest]``) must not change until the sends are done (rank 0's part is a
        view of it where it ends where ``rest`` starts: with one shard, or for the group's
        last member); ``answer`` (1-D CPU ``[params part, B]``) holds this member's part of
        the new model once the receives are done and :meth:`assemble` was called."""
        shards, p = self.topo.shards, self.n_held
        assert shards is not None
        counts = vector[vector.numel() - self.counts :]
        a0, b0 = self.parts[0]
        head = vector[a0:] if b0 == p else torch.cat([vector[a0:b0], vector[p:]])
        self.messages = [head]
        self.head = torch.empty(b0 - a0 + answer.numel() - p, dtype=answer.dtype)
        outs = [self.head]
        owners = [shards.servers[0]]
        for owner, (a, b) in zip(shards.servers[1:], self.parts[1:], strict=True):
            if b > a:
                self.messages.append(torch.cat([vector[a:b], counts]))
                outs.append(answer[a:b])
                owners.append(owner)
        self.answer = answer
        sends: list[Any] = []
        receives: list[Any] = []
        for owner, message, out in zip(owners, self.messages, outs, strict=True):
            link = shards.link(owner, shards.rank)
            sends += post_pieces(message, owner, link)
            receives += receive_pieces(out, owner, link)
        return sends, receives

    def assemble(self) -> None:
        """After the receives: slice 0's parameters and the buffers into ``answer`` (this
        member's part of the parameters is whole; :meth:`gather` takes the others')."""
        a0, b0 = self.parts[0]
        self.answer[a0:b0] = self.head[: b0 - a0]
        self.answer[self.n_held :] = self.head[b0 - a0 :]
        self.messages = []

    def round_trip(self, vector: Tensor, answer: Tensor) -> Tensor:
        """A whole round at once: :meth:`post`, wait (as long as a round takes,
        :data:`exchange.STATUS_WAIT`), :meth:`assemble` and :meth:`gather`; returns this
        member's part of the new model ``[params part, B]`` on the group's device (a whole
        group's member: all of it)."""
        sends, receives = self.post(vector, answer)
        wait_all(sends + receives, STATUS_WAIT)
        self.assemble()
        model = answer.to(self.topo.device)
        self.gather(model[: self.n_held])  # on the device: NCCL on a CUDA group
        return model

    def gather(self, params: Tensor) -> None:
        """A whole group: every member's chunk of the new parameters ``params`` ([P], the
        assembled answer's, on the CPU or the group's device: then over the group itself,
        NCCL on a CUDA group) on every member; every member of the group calls it at the same
        point. A sharded group's member holds its rows only: nothing to gather."""
        if self.gathers:
            gather_chunks(self.topo, params, self.chunks)


class ServerShards:
    """Rank 0's side of the sharded parameter server for one attempt: made when training
    starts, it sends every other owner its slice of the global model (and of the outer
    optimizer's momentum, resumed from ``outer_state``, a checkpoint's ``outer_optimizer``)
    and lets the model's parameters go, keeping slice 0; :meth:`mean_round` and
    :meth:`outer_round` serve slice 0; :meth:`write_model` has every owner write its slice of
    a checkpoint's model."""

    def __init__(self, topo: Topology, spec: RunSpec, state: ModelState, outer_state: Any) -> None:
        self.topo, self.spec, self.state = topo, spec, state
        flat = torch.nn.utils.parameters_to_vector(state.params).detach().cpu()
        self.n_params = flat.numel()
        self.bounds = shard_bounds(flat.numel(), len(_owners(topo)))
        # The owners cut the groups' parts of P: a whole group's chunks, a sharded one's rows.
        self.shapes = [tuple(p.shape) for p in state.params]
        send_layout(topo, self.n_params, self.shapes)
        self.dtype = flat.dtype
        trainable = torch.cat([torch.full((p.numel(),), p.requires_grad) for p in state.params])
        mask = None if bool(trainable.all()) else trainable.to(flat.dtype)
        momentum = flat_momentum(state.params, outer_state) if outer_state else None
        self.outer: OuterSlice | None = None
        # periodic: slice 0 of the global model (diloco's is its outer optimizer's parameter)
        self.head = flat[: self.bounds[0][1]].clone() if spec.sync_strategy == "periodic" else None
        if spec.sync_strategy == "diloco":
            head = flat[: self.bounds[0][1]]
            head_momentum = None if momentum is None else momentum[: self.bounds[0][1]]
            head_mask = None if mask is None else mask[: self.bounds[0][1]].clone()
            self.outer = OuterSlice(spec, head, head_momentum, head_mask)
        flags = (WITH_MOMENTUM if momentum is not None else 0) | (
            WITH_MASK if mask is not None else 0
        )
        _command(topo, LOAD, self.bounds, flat.dtype, [], flags)
        sends: list[Any] = []
        for owner, (a, b) in zip(_owners(topo)[1:], self.bounds[1:], strict=True):
            link = topo.link(owner)
            parts = [flat[a:b]]
            if momentum is not None:
                parts.append(momentum[a:b])
            if mask is not None:
                parts.append(mask[a:b])
            sends += [w for part in parts for w in post_pieces(part.contiguous(), owner, link)]
        wait_all(sends)
        # Rank 0 keeps slice 0 (its owner's: with one shard all of it, once, as its outer
        # optimizer's parameter or the mean) and the buffers: the owners write the model's
        # checkpoints (:meth:`write_model`) and every group ends an epoch holding the global
        # model, so nothing reads the model's parameters on rank 0 again.
        assert state.n_params == self.n_params  # counted (and kept) before they go
        for param in state.params:
            param.data = param.data.new_empty(0)
        report.log(
            f"rank 0 keeps slice 0 of the model ({self.bounds[0][1]} of {self.n_params} "
            f"parameter elements); the {len(self.bounds)} owner(s) write its checkpoints"
        )

    def write_model(
        self, name: str, model: torch.nn.Module
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
        """Checkpoint ``name``'s model, written by every owner at once, each its slice (and
        its slice of the outer momentum) into ``<name>.s<shard>.dcp`` in its checkpoint
        folder (:func:`write_slice`): nothing is gathered. Returns the checkpoint's
        ``(model, model_slices, outer_optimizer)`` entries
        (``contracts.sharded_state.MODEL_SLICES``; ``outer_optimizer`` None under
        ``periodic``). Raises RuntimeError naming the shard whose write failed."""
        owners = _owners(self.topo)
        _command(self.topo, WRITE, self.bounds, self.dtype, [])
        for owner in owners[1:]:
            send_object(name, owner, self.topo)
        head_momentum = self.outer.momentum() if self.outer is not None else None
        folder = Path(self.spec.checkpoint_dir) / sharded_state.slice_folder(name, 0)
        answers = [write_slice(folder, self.head_slice(), head_momentum)]
        answers += [recv_object(owner, self.topo) for owner in owners[1:]]
        for shard, answer in enumerate(answers):
            if "error" in answer:
                raise RuntimeError(
                    f"shard {shard} of the parameter server (rank {owners[shard]}) could not "
                    f"write its slice of the model for {name}: {answer['error']}"
                )
        index = {id(p): i for i, p in enumerate(self.state.params)}
        names = {n: index[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
        offsets = [0]
        for shape in self.shapes:
            offsets.append(offsets[-1] + math.prod(shape))
        outline, slices = sharded_state.model_outline(
            model.state_dict(), names, list(zip(offsets, self.shapes, strict=False))
        )
        slices["slices"] = [
            {"folder": sharded_state.slice_folder(name, s), "files": answer["files"]}
            for s, answer in enumerate(answers)
        ]
        outer = None
        if self.outer is not None:
            sgd = sgd_over(self.spec, self.state.params).state_dict()
            marker = sharded_state.marked(self.dtype)
            if head_momentum is not None:
                trainable = [i for i, p in enumerate(self.state.params) if p.requires_grad]
                sgd["state"] = {i: {"momentum_buffer": marker} for i in trainable}
            outer = sgd
        return outline, slices, outer

    def _round(self, op: int, leaders: list[int], answer: Callable[[Tensor], Tensor]) -> None:
        """Command the round and serve slice 0 with ``answer``."""
        head_end, n_buffers = self.bounds[0][1], self.state.n_buffers
        rounds = round_dtype(self.spec.sync_strategy, self.dtype)
        _command(self.topo, op, self.bounds, self.dtype, leaders)
        assert self.topo.shards is not None
        extra = n_buffers + 1 + COUNTS[self.spec.sync_strategy]  # rest: changes, loss, counts
        groups = _group_indices(self.topo, leaders)
        plan = round_plan(
            self.spec, self.n_params, self.shapes, 0, head_end, groups, keep_empty=True
        )
        serve_parts(self.topo.shards, plan, head_end, extra, rounds, answer)

    def head_slice(self) -> Tensor:
        """Slice 0 of the global model as rank 0 holds it now (``periodic``: the last mean;
        ``diloco``: its outer optimizer's parameter)."""
        head = self.outer.param.detach() if self.outer is not None else self.head
        assert head is not None
        return head

    def mean_round(self, leaders: list[int]) -> tuple[float, float]:
        """``periodic``'s sync point with the groups of ``leaders`` (global ranks): slice 0 and
        rank 0's buffers end as the unsharded average leaves them. Returns ``(loss sum,
        samples)``."""
        head_end, state = self.bounds[0][1], self.state
        sums: list[float] = []

        def answer(total: Tensor) -> Tensor:
            count = float(total[-1])
            sums.extend([float(total[-2]), count])
            if count > 0:
                self.head = total[:head_end] / total[-1]
                state.add_mean_change(None, total[head_end:-2], count)
            assert self.head is not None
            return torch.cat([self.head, state.buffers_vector().cpu()])

        self._round(MEAN, leaders, answer)
        return sums[0], sums[1]

    def outer_round(self, leaders: list[int]) -> tuple[float, float]:
        """``diloco``'s round end with the groups of ``leaders``: the outer step on slice 0, the
        buffers' mean change, the other owners' steps. Returns ``(loss sum, samples)``."""
        head_end, state, outer = self.bounds[0][1], self.state, self.outer
        assert outer is not None
        sums: list[float] = []

        def answer(total: Tensor) -> Tensor:
            sums.extend([float(total[-3]), float(total[-1])])
            outer.step(total[:head_end], float(total[-2]), float(total[-1]))
            if float(total[-1]) > 0:
                state.add_mean_change(None, total[head_end:-3], float(total[-1]))
            rounds = total.dtype
            return torch.cat(
                [outer.param.detach().to(rounds), state.buffers_vector().cpu().to(rounds)]
            )

        self._round(OUTER, leaders, answer)
        return sums[0], sums[1]


def sgd_over(spec: RunSpec, params: list[Any]) -> torch.optim.SGD:
    """The outer optimizer of ``spec`` over ``params``: SGD with ``outer_lr`` and, when
    ``outer_momentum`` > 0, Nesterov momentum (DiLoCo, Douillard et al. 2023)."""
    momentum = spec.outer_momentum
    return torch.optim.SGD(params, lr=spec.outer_lr, momentum=momentum, nesterov=momentum > 0)


def flat_momentum(params: list[torch.nn.Parameter], outer_state: dict[str, Any]) -> Tensor | None:
    """The momentum of a checkpoint's ``outer_optimizer`` (one SGD's state over ``params``) as
    one vector [P], zeros for the parameters that have none (frozen); None when it holds no
    momentum (no outer step yet, or none asked for)."""
    sgd = torch.optim.SGD(params, lr=1.0)
    sgd.load_state_dict(outer_state)
    buffers = [sgd.state.get(p, {}).get("momentum_buffer") for p in params]
    if all(b is None for b in buffers):
        return None
    parts = [
        torch.zeros(p.numel(), dtype=p.dtype) if b is None else b.detach().reshape(-1).cpu()
        for p, b in zip(params, buffers, strict=True)
    ]
    return torch.cat(parts)


class OuterSlice:
    """The outer optimizer over one slice of the flat parameters: a ``torch.optim.SGD`` (the
    unsharded server's, :func:`sgd_over`) over a flat parameter holding the slice, so each
    element takes the same steps as in the unsharded server's optimizer. ``mask`` (1 for a
    trainable element, 0 for a frozen one; None: all trainable) keeps frozen elements where
    they are, as an SGD that skips their parameters would."""

    def __init__(
        self, spec: RunSpec, values: Tensor, momentum: Tensor | None, mask: Tensor | None
    ) -> None:
        self.param = torch.nn.Parameter(values.detach().clone())
        self.sgd = sgd_over(spec, [self.param])
        self.mask = mask
        if momentum is not None and spec.outer_momentum > 0:
            self.sgd.state[self.param]["momentum_buffer"] = momentum.detach().clone()

    @torch.no_grad()
    def step(self, weighted: Tensor, weighted_steps: float, samples: float) -> None:
        """One outer step from the groups' summed ``n_g Delta_g / tau_g`` slice, ``sum n_g
        tau_g`` and ``sum n_g`` (none when no sample was taken)."""
        if samples <= 0:
            return
        tau_eff = weighted_steps / samples
        update = weighted * (tau_eff / samples)
        if self.mask is not None:
            update = update * self.mask.to(update.dtype)
        self.param.grad = update.to(self.param.dtype)
        self.sgd.step()
        self.sgd.zero_grad(set_to_none=True)

    def momentum(self) -> Tensor | None:
        """The momentum of the slice, None before the first step (or without momentum)."""
        buffer = self.sgd.state.get(self.param, {}).get("momentum_buffer")
        return None if buffer is None else buffer.detach()


def serve(topo: Topology, spec: RunSpec) -> None:
    """A shard owner other than rank 0: answer rank 0's commands until :data:`STOP`.

    Raises RuntimeError for a round before its slice was loaded, and what a receive raises (a
    peer gone, or no command within :data:`exchange.STATUS_WAIT`).
    """
    shards = topo.shards
    assert shards is not None and shards.shard not in (None, 0)
    header = torch.empty(4 + len(topo.groups), dtype=torch.int64)
    held: Tensor | None = None
    outer: OuterSlice | None = None
    rows: RowSum | None = None
    total: int | None = None  # the length of the vector whose slices the shards own
    shapes: list[tuple[int, ...]] = []  # the parameters' (a sharded group's rows follow them)
    link = topo.link(0)
    while True:
        work = dist.irecv(header, src=0, group=link, tag=CONTROL_TAG)
        assert work is not None
        work.wait(STATUS_WAIT)
        op, numel, dtype, flags = (int(v) for v in header[:4])
        model_dtype = DTYPES[dtype]
        rounds = round_dtype(spec.sync_strategy, model_dtype)
        if op == STOP:
            return
        if op == LOAD:
            parts = [torch.empty(numel, dtype=model_dtype)]
            parts += [torch.empty(numel, dtype=model_dtype) for bit in (1, 2) if flags & bit]
            wait_all([w for part in parts for w in receive_pieces(part, 0, link)])
            momentum = parts[1] if flags & WITH_MOMENTUM else None
            mask = parts[-1] if flags & WITH_MASK else None
            held = parts[0]  # periodic's slice of the global model; diloco's is outer's
            if spec.sync_strategy == "diloco":
                outer, held = OuterSlice(spec, parts[0], momentum, mask), None
            continue
        leaders = [ranks[0] for ranks, bit in zip(topo.groups, header[4:], strict=True) if bit]
        if op == LAYOUT:
            code = torch.empty(numel, dtype=torch.int64)
            dist.recv(code, 0, link, CONTROL_TAG)
            total, shapes = _layout(code)
            if spec.sync_strategy == "sync":
                rows = RowSum(spec, total, shapes, len(shards.servers), shards.shard)
            continue
        if op == SUM:
            if rows is None:
                raise RuntimeError(f"shard {shards.shard}: a step before the layout came")
            rows.serve(shards, model_dtype, _group_indices(topo, leaders))
            continue
        if op == WRITE:
            name = recv_object(0, topo)
            slice_ = outer.param if outer is not None else held
            if slice_ is None:
                raise RuntimeError(f"shard {shards.shard}: a checkpoint before its slice came")
            folder = Path(spec.checkpoint_dir) / sharded_state.slice_folder(name, shards.shard)
            momentum = outer.momentum() if outer is not None else None
            send_object(write_slice(folder, slice_, momentum), 0, topo)
            continue
        slice_ = outer.param if outer is not None else held
        if slice_ is None or slice_.numel() != numel or total is None:
            raise RuntimeError(f"shard {shards.shard}: a round before its slice was loaded")
        lo, hi = shard_bounds(total, len(shards.servers))[shards.shard]
        groups = _group_indices(topo, leaders)
        plan = round_plan(spec, total, shapes, lo, hi, groups, keep_empty=False)
        if op == MEAN:
            assert held is not None
            held = serve_parts(shards, plan, numel, 1, rounds, _mean(held))
        else:
            assert outer is not None
            serve_parts(shards, plan, numel, 2, rounds, _outer(outer))


def _mean(held: Tensor) -> Callable[[Tensor], Tensor]:
    """The owner's answer to ``[sum of n_g theta_g slices, sum of n_g]``: the mean slice, or
    ``held`` (the global model's slice) when no sample was taken."""

    def answer(total: Tensor) -> Tensor:
        return total[:-1] / total[-1] if float(total[-1]) > 0 else held

    return answer


def _outer(outer: OuterSlice) -> Callable[[Tensor], Tensor]:
    """The owner's answer to ``[sum of n_g Delta_g / tau_g slices, sum n_g tau_g, sum n_g]``:
    its slice after one outer step, in the rounds' dtype."""

    def answer(total: Tensor) -> Tensor:
        outer.step(total[:-2], float(total[-2]), float(total[-1]))
        return outer.param.detach().to(total.dtype)  # sent before the next step changes it

    return answer
