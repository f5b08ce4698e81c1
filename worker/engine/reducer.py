"""The synchronous step's gradient sum, reduced while the backward pass runs.

The sync strategy (:mod:`worker.engine.strategy_sync`) needs, on every compute
worker, the sum over all workers of the vector (periodic and quorum the same sum
over the worker's group only, their exact in-group step)
``[grad_sum (P), buffer_change_sum (B), loss_sum, count]``
(:func:`worker.engine.compute.local_gradient` gives one worker's). A
:class:`GradientReducer` builds that vector in place of the local one and sums
it while backward is still computing, as ``DistributedDataParallel`` does
(Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020): the parameters are cut into buckets in reverse order
(the order backward produces their gradients; the first bucket small, so
communication starts early), a hook on each parameter
(``register_post_accumulate_grad_hook``) writes ``count * grad`` into the
bucket's slice of the flat vector, and once a bucket is complete and every
bucket before it has been launched, an asynchronous allreduce of it starts
(gloo runs it on its own threads). Launching strictly in bucket order keeps
the collectives in the same order on every rank whatever order the hooks
fire in; a parameter that received no gradient (unused in this forward, or a
worker with no samples in the step) counts as zeros, and its bucket is
launched after backward. The tail ``[buffer_change_sum, loss_sum, count]`` is
known after the forward pass and rides in the first bucket.

Two levels, as the groups are built (docs/architecture.md, "Training engine"):
the sum inside the resource group (allreduce over the group), then, with more
than one group, over the group leaders (a ring allreduce over links between
neighbouring leaders, :class:`worker.engine.ring.LeaderRing`, bandwidth-optimal:
each leader sends and receives ``2 (G - 1) / G`` of the vector, where a
parameter server's link carries all G vectors in and out),
then a broadcast from the leader inside the group; with a parameter server in shards
(``ps_shards``) the owners sum across the groups instead (``owners``,
:class:`worker.engine.shard_server.OwnerSum`): each member sends its chunk of the group's
sum, each piece once its buckets are summed in the group (with one worker per group, once
backward has written them), and the members gather their summed chunks in place of the
broadcast. With one worker per group
the leaders' allreduce is the one the hooks launch; with one group, the
in-group allreduce is the whole sum.

Every worker ends with bitwise the same vector (a ring allreduce gives every
member the same bits, as the owners' one sum does; the broadcast or the gathering of the
chunks copies them), so every worker stepping
its own replica of the optimizer from it keeps identical parameters.
"""

from __future__ import annotations

import itertools
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from worker.engine.distributed import Topology
from worker.engine.ring import LeaderRing

# As DistributedDataParallel's defaults: a small first bucket, then 25 MB buckets.
FIRST_BUCKET_BYTES = 1 * 2**20
BUCKET_BYTES = 25 * 2**20


def plan_buckets(
    sizes: list[int], element_size: int, first: int = FIRST_BUCKET_BYTES, rest: int = BUCKET_BYTES
) -> list[tuple[int, int]]:
    """Buckets of parameter indices ``[start, stop)`` in reverse order, last parameters first.

    ``sizes`` are the parameters' element counts in flat-vector order. A bucket
    takes parameters from the end until adding the next would exceed its byte
    cap (``first`` for the first bucket, ``rest`` after); a parameter larger
    than the cap is a bucket of its own. Returns an empty list for no parameters.
    """
    buckets: list[tuple[int, int]] = []
    stop = len(sizes)
    while stop > 0:
        cap = first if not buckets else rest
        start, nbytes = stop - 1, sizes[stop - 1] * element_size
        while start > 0 and nbytes + sizes[start - 1] * element_size <= cap:
            start -= 1
            nbytes += sizes[start] * element_size
        buckets.append((start, stop))
        stop = start
    return buckets


class CrossSum(Protocol):
    """The sum over the groups of a member's chunk of its group's step vector, by others than
    the leaders' ring (the parameter server's shards,
    :class:`worker.engine.shard_server.OwnerSum`): begun with the vector (CPU), told as its
    elements from an index to the end become final, finished with the sum written into the
    chunk (or all at once on any device, :meth:`sum_whole`); :meth:`gather` then gives
    every member of the group the others' chunks."""

    def begin(self, vector: Tensor) -> None: ...

    def ready(self, start: int) -> None: ...

    def finish(self) -> None: ...

    def sum_whole(self, vector: Tensor) -> None: ...

    def gather(self, vector: Tensor) -> None: ...


class GradientReducer:
    """Sum of ``[count * grad (P), tail (T)]`` over every compute worker, overlapped with backward.

    Built once per worker for the model's ``params`` (flat-vector order), a
    tail of ``tail_numel`` elements and ``n_groups``, the groups the sum spans:
    the task's groups (sync), or 1 for the sum inside this worker's group only
    (periodic's and quorum's exact in-group step); ``cross`` the leaders' ring when
    it is not the topology's (:func:`worker.engine.run.step_groups`); ``owners`` the
    groups' sum in place of the leaders' ring and broadcast (:class:`CrossSum`, the shard owners':
    :class:`worker.engine.shard_server.OwnerSum`). Per step:
    :meth:`begin` with the local sample count (arms the hooks), the forward
    pass, :meth:`set_tail`, the backward pass, then :meth:`finish`, which
    returns the global sum, shape [P + T], on ``topo.device``. Outside
    begin/finish (profiling, validation) the hooks do nothing. Raises
    RuntimeError if built on the parameter server.
    """

    def __init__(
        self,
        topo: Topology,
        params: list[torch.nn.Parameter],
        tail_numel: int,
        n_groups: int,
        *,
        cross: LeaderRing | None = None,
        owners: CrossSum | None = None,
    ) -> None:
        if topo.group is None:
            raise RuntimeError("the gradient reducer is for compute workers")
        self.topo = topo
        self.params = params
        sizes = [p.numel() for p in params]
        self.offsets = list(itertools.accumulate(sizes, initial=0))
        self.numel = self.offsets[-1] + tail_numel
        element_size = params[0].element_size() if params else 4
        self.buckets = plan_buckets(sizes, element_size)
        self.bucket_of = [0] * len(params)
        for k, (start, stop) in enumerate(self.buckets):
            for i in range(start, stop):
                self.bucket_of[i] = k
        self.in_group = topo.group if len(topo.group_ranks) > 1 else None
        self.multi_group = n_groups > 1
        # On the leaders, when the sum spans more than one group: ``cross`` when given (the
        # leaders of the groups the guard has not parked), else the topology's.
        self.cross = (cross or topo.cross) if self.multi_group else None
        self.owners = owners if self.multi_group else None
        if self.owners is not None:
            self.cross = None  # the owners sum instead, piece by piece
        # The owners take each member's chunk of the vector itself as its pieces are final (on
        # a CPU group; elsewhere a CPU copy once the group's sum is done).
        self.streams = self.owners is not None and topo.device.type == "cpu"
        # The collective the hooks launch: the in-group sum, or with one worker per group the
        # leaders' sum. (On a non-CPU device the leaders' gloo sum waits for the end.)
        self.first_stage: dist.ProcessGroup | LeaderRing | None = self.in_group
        if self.first_stage is None and self.cross is not None and topo.device.type == "cpu":
            self.first_stage = self.cross
        self.armed = False
        self.flat = torch.zeros(0)
        self._views(self.flat)
        self.written: list[bool] = []
        # The step's local sample count as a float64 scalar tensor, refilled each step: the
        # hooks' products are bitwise those with the Python float (it converts the same way),
        # without wrapping a new scalar for every parameter (a third of the product's cost).
        self.count = torch.zeros((), dtype=torch.float64)
        self.pending: list[int] = []
        self.launched: list[Any] = []
        self.next_bucket = 0
        self.handles = [
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._ready(i))  # type: ignore[misc]
            for i, p in enumerate(params)
            if p.requires_grad
        ]
        self.trainable = [p.requires_grad for p in params]
        # Each step starts from these (copied): frozen parameters never get a gradient, so
        # they count as written (zeros, kept) and ready from the start; the first bucket
        # also waits for the tail.
        self._written_at_begin = [not trainable for trainable in self.trainable]
        self._pending_at_begin = [
            sum(1 for i in range(start, stop) if self.trainable[i]) for start, stop in self.buckets
        ]
        if self._pending_at_begin:
            self._pending_at_begin[0] += 1

    def _views(self, flat: Tensor) -> None:
        """The views of ``flat`` a step uses, made once per vector (a step makes none): each
        parameter's slice shaped as the parameter (``param_slices``), each bucket's span
        (``bucket_spans``), the tail (``tail``), and the trainable parameters' slices paired
        with them (``grad_views``, for :meth:`set_grads`)."""
        if flat.numel() != self.numel:  # not allocated yet (or let go): nothing to view
            self.param_slices: list[Tensor] = []
            self.bucket_spans: list[Tensor] = []
            self.tail = flat
            self.grad_views: list[tuple[torch.nn.Parameter, Tensor]] = []
            return
        offsets = self.offsets
        self.param_slices = [
            flat[offsets[i] : offsets[i + 1]].view(p.shape) for i, p in enumerate(self.params)
        ]
        self.bucket_spans = [flat[a:b] for a, b in map(self._span, range(len(self.buckets)))]
        self.tail = flat[offsets[-1] :]
        pairs = zip(self.params, self.param_slices, strict=True)
        self.grad_views = [(p, view) for p, view in pairs if p.requires_grad]

    def close(self) -> None:
        """Remove the hooks and let go of the vector (at the end of training)."""
        for handle in self.handles:
            handle.remove()
        self.handles, self.launched, self.flat = [], [], torch.zeros(0)
        self._views(self.flat)

    def begin(self, count: int) -> None:
        """Start a step of ``count`` local samples, every bucket waiting.

        The flat vector is allocated once and rewritten every step (the optimizer's
        gradients of the last step, views of it, are gone by now): every slice is
        written by its hook or zeroed before its bucket goes out.
        """
        if self.flat.numel() != self.numel:
            self.flat = torch.zeros(self.numel, dtype=self.params[0].dtype, device=self.topo.device)
            self._views(self.flat)
        self.written = self._written_at_begin.copy()
        self.count.fill_(count)
        self.pending = self._pending_at_begin.copy()
        self.launched, self.next_bucket, self.armed = [], 0, True
        if self.streams:
            assert self.owners is not None
            self.owners.begin(self.flat)

    def set_tail(self, tail: Tensor | None = None) -> None:
        """Write the tail (e.g. ``[buffer_change_sum, loss_sum, count]``); call once per step,
        after the forward pass and before backward. ``None``: the caller has written it in
        place, into :attr:`tail` (the flat vector's last elements)."""
        if tail is not None:
            self.tail.copy_(tail)
        if self.pending:
            self.pending[0] -= 1
        self._launch_ready()

    def set_grads(self) -> None:
        """Make each trainable parameter's ``.grad`` its slice of the flat vector (views, as
        :func:`worker.engine.exchange.vector_to_grads` makes them, without making new ones);
        frozen parameters keep ``grad=None``. The caller must not change the vector until
        the optimizer has stepped and the gradients were set to None."""
        for p, view in self.grad_views:
            p.grad = view

    def _span(self, k: int) -> tuple[int, int]:
        """Element range of bucket ``k`` in the flat vector (the first also holds the tail)."""
        start, stop = self.buckets[k]
        end = self.numel if k == 0 else self.offsets[stop]
        return self.offsets[start], end

    def _ready(self, i: int) -> None:
        # No torch.no_grad() needed (nor paid for, every parameter of every step): the
        # gradient of a backward without create_graph does not require grad, and the flat
        # vector never does, so the product records nothing.
        if not self.armed:
            return
        written = self.written
        if written[i]:
            raise RuntimeError(
                f"parameter {i} received its gradient twice in one backward pass (reentrant "
                "torch.utils.checkpoint, or one parameter in two checkpointed segments); use "
                "torch.utils.checkpoint(..., use_reentrant=False)"
            )
        grad = self.params[i].grad
        if grad is not None:
            torch.mul(grad.detach(), self.count, out=self.param_slices[i])
            written[i] = True
        self.pending[self.bucket_of[i]] -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next_bucket < len(self.buckets) and self.pending[self.next_bucket] <= 0:
            self._launch(self.next_bucket)
            self.next_bucket += 1

    def _launch(self, k: int) -> None:
        start, stop = self.buckets[k]
        for i in range(start, stop):
            if not self.written[i]:  # no gradient this step (unused, or no samples): zeros
                self.param_slices[i].zero_()
        self.launched.append(self._reduce_async(self.bucket_spans[k]))
        if self.streams and self.first_stage is None:  # no group sum: final once written
            assert self.owners is not None
            self.owners.ready(self._span(k)[0])

    def finish(self) -> Tensor:
        """Launch what backward left (parameters without a gradient: zeros), wait, and return
        the global sum [P + T] (the same bits on every worker)."""
        while self.next_bucket < len(self.buckets):
            self._launch(self.next_bucket)
            self.next_bucket += 1
        if not self.buckets:  # no parameters: the tail alone
            self.launched.append(self._reduce_async(self.flat))
        self.armed = False
        for k, work in enumerate(self.launched):
            if work is not None:
                work.wait()
                if self.streams and self.buckets:  # bucket k summed in the group: final
                    assert self.owners is not None
                    self.owners.ready(self._span(k)[0])
        # No finished work object outlives the step: one holding a tensor at interpreter exit
        # can abort the process when gloo's threads release it (pytorch/pytorch#179291).
        self.launched = []
        if self.cross is not None and self.first_stage is not self.cross:
            self._leaders_sum()
        if self.owners is not None:  # every member's chunk, then the chunks gathered
            if self.streams:
                self.owners.finish()
            else:
                self.owners.sum_whole(self.flat)
            self.owners.gather(self.flat)
        elif self.in_group is not None and self.multi_group:
            dist.broadcast(self.flat, src=self.topo.group_ranks[0], group=self.in_group)
        return self.flat

    def _reduce_async(self, span: Tensor) -> Any:
        """Launch the hooks' collective (:attr:`first_stage`) on ``span``; None without one."""
        if self.first_stage is None:
            return None
        if isinstance(self.first_stage, LeaderRing):
            return self.first_stage.all_reduce(span, async_op=True)
        return dist.all_reduce(span, op=dist.ReduceOp.SUM, group=self.first_stage, async_op=True)

    def _leaders_sum(self) -> None:
        """The leaders' allreduce after the in-group sums (gloo, on CPU), bucket by bucket."""
        cross = self.cross
        if cross is None or not self.topo.am_i_leader:
            return
        on_cpu = self.flat.cpu()
        spans = [self._span(k) for k in range(len(self.buckets))] or [(0, self.numel)]
        works = [cross.all_reduce(on_cpu[a:b], async_op=True) for a, b in spans]
        for work in works:
            work.wait()
        if on_cpu.data_ptr() != self.flat.data_ptr():
            self.flat.copy_(on_cpu)
