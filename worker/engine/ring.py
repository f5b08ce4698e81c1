"""The group leaders' allreduce over a ring of two-rank links (docs/architecture.md).

Under ``sync`` the step's sum spans the groups: each group sums inside itself, then the
group leaders sum among themselves. A gloo group of the G leaders would connect every pair of
them when made, G (G - 1) / 2 connections, although a ring allreduce talks to two neighbours
only (and gloo's lazy connections, which would open just those, abort a rank in torch 2.13:
worker/engine/distributed.py, "Process groups"). So the leaders form a ring of two-rank gloo
groups, each leader linked to the next (G links; one for two leaders), and
:class:`LeaderRing` runs the ring allreduce over them: a reduce-scatter, then an allgather,
each G - 1 steps in which every leader sends one chunk (1/G of the tensor) to the next and
receives one from the previous (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms
for clusters of workstations", JPDC 2009: the algorithm of gloo's and NCCL's rings). Each
leader sends and receives 2 (G - 1) / G of the tensor, as in gloo's own ring. Each chunk is
reduced once, at one leader, in the ring's order, and then copied to the others, so every
leader ends with bitwise the same tensor.

With two leaders the ring is their one link, whose gloo allreduce is used as it is.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def ring_pairs(members: Sequence[int]) -> list[frozenset[int]]:
    """The links a ring of ``members`` (global ranks, in ring order) needs: each member with
    the next, the last with the first; one for two members, none for fewer."""
    if len(members) < 2:
        return []
    pairs = [frozenset({members[i], members[(i + 1) % len(members)]}) for i in range(len(members))]
    return list(dict.fromkeys(pairs))


_COMBINE: dict[Any, Callable[[Tensor, Tensor], Any]] = {
    dist.ReduceOp.SUM: lambda mine, theirs: mine.add_(theirs),
    dist.ReduceOp.PRODUCT: lambda mine, theirs: mine.mul_(theirs),
    dist.ReduceOp.MAX: lambda mine, theirs: torch.maximum(mine, theirs, out=mine),
    dist.ReduceOp.MIN: lambda mine, theirs: torch.minimum(mine, theirs, out=mine),
}


class RingWork:
    """A ring allreduce in flight, as torch.distributed's work objects: :meth:`wait`."""

    def __init__(self, future: Future[None]) -> None:
        self.future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the allreduce is done; raise what it raised (a peer's receive timing
        out after the ring's timeout, a closed link)."""
        self.future.result(None if timeout is None else timeout.total_seconds())
        return True


class _Runner:
    """One thread per process that runs the ring allreduces in the order they are launched:
    a launch returns at once (the gradient reducer's buckets, as gloo's async collectives),
    and two allreduces never use a link at the same time. Once one fails (a peer gone, a
    timeout), every later one fails at once with the same error rather than wait out its
    own timeout: the ring's order is broken for good. A process forked from one whose
    thread ran starts a thread of its own (a fork copies no thread)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Callable[[], None], Future[None]]] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.failed: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> Future[None]:
        future: Future[None] = Future()
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.jobs = queue.SimpleQueue()
                self.thread = threading.Thread(target=self._loop, name="leader-ring", daemon=True)
                self.thread.start()
            self.jobs.put((job, future))
        return future

    def _loop(self) -> None:
        jobs = self.jobs
        while True:
            job, future = jobs.get()
            try:
                if self.failed is not None:
                    raise self.failed
                job()
            except BaseException as exc:  # noqa: BLE001 (handed to the waiter, raised there)
                self.failed = exc
                future.set_exception(exc)
            else:
                future.set_result(None)
            del job, future  # nothing of a finished allreduce (its tensors) stays referenced


_RUNNER = _Runner()


class LeaderRing:
    """The allreduce among ``members`` (global ranks, in ring order; this process's ``rank``
    among them) over their ring's two-rank gloo groups.

    ``links`` maps each pair of :func:`ring_pairs` this rank belongs to onto its group;
    ``timeout`` bounds each send and receive. Raises ValueError when ``rank`` is not a
    member or there are fewer than two, KeyError naming a missing link.
    """

    def __init__(
        self,
        members: Sequence[int],
        rank: int,
        links: Mapping[frozenset[int], dist.ProcessGroup],
        timeout: timedelta,
    ) -> None:
        if len(members) < 2 or rank not in members:
            raise ValueError(f"rank {rank} cannot form a ring with {list(members)}")
        self.members, self.rank, self.timeout = tuple(members), rank, timeout
        self.position = self.members.index(rank)
        size = len(self.members)
        self.next = self.members[(self.position + 1) % size]
        self.prev = self.members[(self.position - 1) % size]
        self.to_next = links[frozenset({rank, self.next})]
        self.from_prev = links[frozenset({rank, self.prev})]

    @property
    def size(self) -> int:
        """The number of leaders in the ring (G)."""
        return len(self.members)

    def all_reduce(
        self, tensor: Tensor, op: Any = dist.ReduceOp.SUM, async_op: bool = False
    ) -> Any:
        """Reduce the CPU ``tensor`` (any shape, contiguous) with ``op`` (SUM, PRODUCT, MAX or
        MIN) over the ring's members, in place, as ``torch.distributed.all_reduce``: with
        ``async_op`` a work object to :meth:`RingWork.wait` on, else None once done. A tensor
        on another device (a sharded CUDA group's step tail) is reduced through a CPU copy,
        without ``async_op``. Every member must call it alike, in the same order. Raises
        ValueError for another op, a non-contiguous tensor, or ``async_op`` off the CPU."""
        if op not in _COMBINE:
            raise ValueError(f"the leaders' ring cannot reduce with {op}")
        if not tensor.is_contiguous():
            raise ValueError("the leaders' ring reduces contiguous tensors only")
        if tensor.device.type != "cpu":
            if async_op:
                raise ValueError("the leaders' ring reduces a CPU tensor only asynchronously")
            on_cpu = tensor.cpu()
            self.all_reduce(on_cpu, op)
            tensor.copy_(on_cpu)
            return None
        if self.size == 2:
            return dist.all_reduce(tensor, op=op, group=self.to_next, async_op=async_op)
        work = RingWork(_RUNNER.submit(lambda: self._ring(tensor.view(-1), _COMBINE[op])))
        if async_op:
            return work
        work.wait()
        return None

    def _ring(self, flat: Tensor, combine: Callable[[Tensor, Tensor], Any]) -> None:
        size, p = self.size, self.position
        chunks = list(flat.tensor_split(size))
        spare = torch.empty(max(c.numel() for c in chunks), dtype=flat.dtype)
        # Reduce-scatter: at step s, send the chunk (p - s) summed so far, add the previous
        # member's (p - s - 1) to ours; after G - 1 steps chunk (p + 1) is whole here.
        for s in range(size - 1):
            out, into = chunks[(p - s) % size], chunks[(p - s - 1) % size]
            received = spare[: into.numel()]
            self._swap(out, received)
            combine(into, received)
        # Allgather: pass the whole chunks on; chunk (p - s) arrives from the previous member.
        for s in range(size - 1):
            self._swap(chunks[(p + 1 - s) % size], chunks[(p - s) % size])

    def _swap(self, out: Tensor, into: Tensor) -> None:
        """Send ``out`` to the next member while receiving ``into`` from the previous one (an
        empty chunk, of a tensor with fewer elements than members, is neither)."""
        works = []
        if out.numel():
            works.append(dist.isend(out, dst=self.next, group=self.to_next))
        if into.numel():
            works.append(dist.irecv(into, src=self.prev, group=self.from_prev))
        for work in works:
            assert work is not None  # None only outside the group
            work.wait(self.timeout)
