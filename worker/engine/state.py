"""The model's whole state as flat vectors: parameters, then buffers.

Buffers (BatchNorm ``running_mean``/``running_var``/``num_batches_tracked``
and any registered buffer of a floating or integer dtype) change in every
worker's forward pass. They travel with the vectors a step already exchanges
(docs/heterogeneity.md, "Buffers"): a worker's upward vector is
``[grad_sum (P), buffer_change_sum (B), loss_sum, count]``, where the
buffer part is ``count * (buffers after its forward - buffers before it)``.
Summed like the gradients, it gives the sample-weighted mean change, which
the parameter server adds to its own buffers (integer buffers rounded to the
nearest integer, so a counter moves as in one process); the downward vector
is ``[params (P), buffers (B)]``. Buffers of other dtypes (bool masks) are
not exchanged and keep the value every rank built.

A sharded model's parameters (DTensors, :mod:`worker.engine.fsdp`) count and read whole:
``n_params`` is the whole model's, :meth:`ModelState.vector` gathers each parameter over
the group (a collective: every member calls it alike) and :meth:`ModelState.load_` keeps
this worker's rows of the vector it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch import Tensor

from worker.engine.distributed import Topology
from worker.engine.exchange import broadcast_down, params_of
from worker.engine.fsdp import load_rows_, load_whole_, rows_vector
from worker.engine.sharded import local, materialised
from worker.engine.spec import RunSpec


def _exchanged(buffer: Tensor) -> bool:
    return buffer.is_floating_point() or (not buffer.is_complex() and buffer.dtype != torch.bool)


@dataclass
class ModelState:
    """Views of one model's parameters and exchanged buffers, in a fixed order.

    ``n_params`` (P) and ``n_buffers`` (B) are element counts.
    """

    params: list[torch.nn.Parameter]
    buffers: list[Tensor]

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelState:
        """The state of ``model``: its parameters and its floating/integer buffers."""
        return cls(params_of(model), [b for b in model.buffers() if _exchanged(b)])

    @cached_property
    def n_params(self) -> int:
        """P, the number of parameter elements (counted once: the views are fixed)."""
        return sum(p.numel() for p in self.params)

    @cached_property
    def n_buffers(self) -> int:
        """B, the number of exchanged buffer elements (counted once)."""
        return sum(b.numel() for b in self.buffers)

    def snapshot(self) -> list[Tensor]:
        """A copy of the buffers (the base that :meth:`buffer_change` measures from)."""
        return [b.detach().clone() for b in self.buffers]

    def buffer_change(self, base: list[Tensor], weight: float, like: Tensor) -> Tensor:
        """``weight * (buffers - base)`` as one vector [B] of ``like``'s dtype and device."""
        if not self.buffers:
            return like.new_zeros(0)
        parts = [
            (b.detach() - a).reshape(-1).to(like.dtype)
            for b, a in zip(self.buffers, base, strict=True)
        ]
        return torch.cat(parts).to(like.device) * weight

    @torch.no_grad()
    def add_mean_change(self, base: list[Tensor] | None, change_sum: Tensor, count: float) -> None:
        """Set the buffers to ``base + change_sum / count`` (integer buffers rounded).

        ``base`` None means the buffers' current values. ``count`` <= 0 leaves them as they are.
        """
        if count <= 0 or not self.buffers:
            return
        base = base if base is not None else self.buffers
        mean = change_sum / count
        offset = 0
        for buffer, start in zip(self.buffers, base, strict=True):
            n = buffer.numel()
            delta = mean[offset : offset + n].view_as(buffer).to(buffer.device)
            if not buffer.is_floating_point():
                delta = delta.round()
            buffer.copy_(start + delta.to(buffer.dtype))
            offset += n

    @torch.no_grad()
    def restore(self, base: list[Tensor]) -> None:
        """Put the buffers back to ``base`` (a step that is skipped)."""
        for buffer, start in zip(self.buffers, base, strict=True):
            buffer.copy_(start)

    @torch.no_grad()
    def buffers_vector(self) -> Tensor:
        """``[buffers (B)]`` in the parameters' dtype, on the buffers' device (empty: none)."""
        dtype = self.params[0].dtype
        if not self.buffers:
            return torch.zeros(0, dtype=dtype, device=self.params[0].device)
        return torch.cat([b.detach().reshape(-1).to(dtype) for b in self.buffers])

    @torch.no_grad()
    def vector(self, *tail: float) -> Tensor:
        """``[params (P), buffers (B), *tail]`` in the parameters' dtype, on their device;
        a sharded model's parameters gathered whole, one at a time (every member of the
        group calls it alike)."""
        parts = [p.detach().reshape(-1) for p in materialised(self.params)]
        dtype, device = self.params[0].dtype, self.params[0].device
        parts.append(self.buffers_vector())
        if tail:
            parts.append(torch.tensor(tail, dtype=dtype, device=device))
        return torch.cat(parts)

    @cached_property
    def n_held(self) -> int:
        """The parameter elements this worker holds: its rows of a sharded model's
        (:meth:`held_params`), P for a whole model."""
        return sum(local(p).numel() for p in self.params)

    @torch.no_grad()
    def held_params(self, scale: float = 1.0, out: Tensor | None = None) -> Tensor:
        """``scale * [held params (n_held)]``: this worker's rows of every parameter of a
        sharded model, flat and in order (every parameter of a whole one; the layout
        :func:`worker.engine.fsdp.rows_vector` gives this member, which
        :func:`worker.engine.fsdp.assemble_rows_` takes from every member), in the parameters'
        dtype, on their device (nothing is gathered); written into the first ``n_held``
        elements of ``out`` where given (on the parameters' device, of any dtype), without a
        copy between."""
        if out is None:
            params = self.params[0]
            out = torch.empty(self.n_held, dtype=params.dtype, device=params.device)
        offset = 0
        for param in self.params:
            rows = local(param).detach().reshape(-1)
            torch.mul(rows, scale, out=out[offset : offset + rows.numel()])
            offset += rows.numel()
        return out[: self.n_held]

    @torch.no_grad()
    def held_vector(self) -> Tensor:
        """``[held params (n_held), buffers (B)]``: :meth:`vector` as this worker holds it
        (:meth:`held_params`); :meth:`load_held_` takes it back."""
        params = self.params[0]
        out = torch.empty(self.n_held + self.n_buffers, dtype=params.dtype, device=params.device)
        self.held_params(out=out)
        out[self.n_held :] = self.buffers_vector()
        return out

    @torch.no_grad()
    def load_held_(self, vector: Tensor) -> None:
        """Copy ``[held params (n_held), buffers (B)]`` (:meth:`held_vector`'s layout, on any
        device) into this worker's rows of the parameters and into the buffers."""
        read = load_rows_(self.params, vector)
        self.load_buffers_(vector[read:])

    def empty(self) -> Tensor:
        """An uninitialised ``[P + B]`` vector of the parameters' dtype, on their device (a
        buffer to receive :meth:`vector`'s values into)."""
        params = self.params[0]
        return torch.empty(self.n_params + self.n_buffers, dtype=params.dtype, device=params.device)

    @torch.no_grad()
    def load_(self, vector: Tensor) -> None:
        """Copy ``[params (P), buffers (B)]`` (or a longer vector starting so) into the model
        (a sharded parameter takes this worker's rows of its part)."""
        offset = 0
        for param in self.params:
            n = param.numel()
            load_whole_(param, vector[offset : offset + n])
            offset += n
        self.load_buffers_(vector[offset:])

    @torch.no_grad()
    def load_buffers_(self, vector: Tensor) -> None:
        """Copy ``[buffers (B)]`` (or a longer vector starting so) into the buffers (integer
        buffers rounded)."""
        offset = 0
        for buffer in self.buffers:
            n = buffer.numel()
            values = vector[offset : offset + n].view_as(buffer)
            buffer.copy_(values if buffer.is_floating_point() else values.round())
            offset += n


def sync_state(
    topo: Topology,
    state: ModelState,
    leaders: list[int] | None = None,
    spec: RunSpec | None = None,
) -> None:
    """Give every worker the parameter server's parameters and buffers (in place); only the
    groups of ``leaders`` (their leaders' global ranks) when given, and only their workers
    may call it then.

    With ``spec``, a sharded group (:meth:`worker.engine.spec.RunSpec.sharded`) does not take
    the whole vector: the server sends each of its workers that worker's rows of every
    parameter and the buffers (point to point, after the other groups' broadcast), so no
    worker of it receives the whole model."""
    groups = range(len(spec.groups)) if spec is not None else range(0)
    sharded = [g for g in groups if spec is not None and spec.sharded(g)]
    if spec is not None and leaders is not None:
        sharded = [g for g in sharded if spec.group_ranks(g)[0] in leaders]
    if spec is not None and sharded:
        whole = [r for r in (leaders or spec.leader_ranks()) if spec.group_of(r) not in sharded]
        if topo.is_ps:
            if whole:
                broadcast_down(topo, state.vector().cpu(), whole)
            buffers = state.buffers_vector()
            for g in sharded:
                members = spec.group_ranks(g)
                for i, member in enumerate(members):
                    rows = torch.cat([rows_vector(state.params, i, len(members)), buffers])
                    dist.send(rows, member, group=topo.link(member))
            return
        if topo.group_index in sharded:
            held = sum(local(p).numel() for p in state.params)
            received = torch.empty(held + state.n_buffers, dtype=state.params[0].dtype)
            dist.recv(received, src=0, group=topo.link(0))
            read = load_rows_(state.params, received.to(state.params[0].device))
            state.load_buffers_(received[read:])
            return
        leaders = whole
    received = broadcast_down(topo, state.vector().cpu() if topo.is_ps else state.empty(), leaders)
    if not topo.is_ps:
        state.load_(received)
