"""Numerical faults: a non-finite loss, gradient or buffer on any worker.

Detection rides on the sums a step already exchanges: a worker's upward
vector ``[grad_sum, buffer_change_sum, loss_sum, count]`` is summed (in-group
allreduce, then at the parameter server), and any non-finite element of any
worker makes the sum non-finite. Who checks: the parameter server for
``sync`` (it tells every worker in the flag element of the parameters it
broadcasts anyway), every member of the group after its in-group allreduce
for ``periodic`` and ``quorum`` (whose groups step or report on their own).

Where the checker also turns the sum into the mean gradient (``sync``'s
parameter server, ``periodic``'s group members), the check is folded into
that division (:func:`mean_gradient_`): one fused in-place pass multiplies
the gradient part by ``1 / count`` and flags any non-finite element, so
detection adds no pass over the gradient (``bench/nonfinite_check.py``). A
``quorum`` member sends the group's raw sum, which the parameter server
divides per step, so it checks with :func:`all_finite` (one sum over it).

Only once a sum is non-finite do the stepping workers (``sync``) or the group
(the others) run one more collective, :func:`blame`, in which every worker marks
whether its own loss, gradient or buffers were non-finite, so the reason
names epoch, step, rank and group. With ``on_nonfinite: fail`` every rank
that saw the fault raises :class:`NonFiniteError` before anything is
stepped or checkpointed, so the last checkpoint is the last good one; with
``skip_step`` the step is skipped (parameters and buffers as before it) and
counted in the epoch's ``skipped_steps`` metric.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from worker.engine.spec import RunSpec

KINDS = ("loss", "gradient", "buffers")


def all_finite(vector: Tensor) -> bool:
    """True when every element of ``vector`` is finite.

    One sum (a NaN or infinite element makes it non-finite), about 30 times
    cheaper than an element-wise test; only a non-finite sum, which a huge
    but finite vector could also give by overflow, is tested element by element.
    """
    if math.isfinite(float(vector.sum())):
        return True
    return bool(torch.isfinite(vector).all())


# Dtypes the fused kernel takes (its factor is a float32 ``1 / count``): the product is within
# one rounding of ``grad_sum / count`` (bit-equal for a power-of-two count, and for float16 and
# bfloat16); float64, whose 1 / count a float32 factor would round, divides instead.
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A tail (buffer changes, loss, count) of at most this many elements is checked in Python.
SHORT_TAIL = 64


def mean_gradient_(total: Tensor, n_params: int) -> bool:
    """In place, ``total[:n_params] /= count``; True when every element of ``total`` is finite.

    ``total`` is a summed step vector ``[grad_sum (n_params), buffer_change_sum
    (B), loss_sum, count]`` (any device; count a whole number of samples); on
    return its first ``n_params`` elements are the mean gradient over the
    step's samples (the units of one sample's gradient) and the rest is
    unchanged. The short tail (buffer changes, loss, count) is tested element
    by element first; a non-finite one returns False without dividing. The
    gradient is multiplied by ``1 / count`` and tested in the same pass by
    ``torch._amp_foreach_non_finite_check_and_unscale_``, the unscale and
    check kernel of ``torch.amp.GradScaler``, which flags non-finite inputs
    (so a huge but finite vector whose sum would overflow is not flagged): the
    result is within one rounding of ``grad_sum / count``. A float64 vector
    is divided in place and then checked with :func:`all_finite`; a step
    without samples (count 0) is only checked. After False the gradient part
    may be partly scaled: the caller must not apply it.
    """
    tail = total[n_params:]
    if tail.numel() <= SHORT_TAIL:  # read at once: cheaper than a kernel and a sync for a few
        values = tail.tolist()
        if not all(map(math.isfinite, values)):
            return False
        count = round(values[-1])
    else:
        if not bool(torch.isfinite(tail).all()):
            return False
        count = round(float(tail[-1]))
    grads = total[:n_params]
    if count <= 0 or total.dtype not in FUSED_DTYPES:
        if count > 0:
            grads.div_(count)
        return all_finite(grads)
    found, inverse = _kernel_scalars(total.device)
    found.zero_()
    inverse.fill_(1.0 / count)  # rounded to float32 as torch.full((1,), 1.0 / count) rounds it
    torch._amp_foreach_non_finite_check_and_unscale_([grads], found, inverse)
    return not bool(found.item())


_KERNEL_SCALARS: dict[torch.device, tuple[Tensor, Tensor]] = {}


def _kernel_scalars(device: torch.device) -> tuple[Tensor, Tensor]:
    """The fused kernel's ``found`` flag and ``1 / count`` factor on ``device``, made once per
    device and refilled every call (a step allocates neither). float32 whatever torch's
    default dtype is (user code may change it): the kernel's demand."""
    scalars = _KERNEL_SCALARS.get(device)
    if scalars is None:
        scalars = _KERNEL_SCALARS[device] = (
            torch.zeros(1, dtype=torch.float32, device=device),
            torch.ones(1, dtype=torch.float32, device=device),
        )
    return scalars


class NonFiniteError(RuntimeError):
    """A non-finite loss, gradient or buffer; the message names epoch, step, rank and group."""


def local_faults(
    loss_sum: float, params: list[torch.nn.Parameter], buffers: list[Tensor]
) -> list[bool]:
    """Whether this worker's own ``loss_sum``, gradients and floating buffers are non-finite."""
    grads = [p.grad for p in params if p.grad is not None]
    floating = [b for b in buffers if b.is_floating_point()]
    return [
        not torch.isfinite(torch.tensor(loss_sum)).item(),
        any(not bool(torch.isfinite(g).all()) for g in grads),
        any(not bool(torch.isfinite(b).all()) for b in floating),
    ]


def blame(
    spec: RunSpec,
    worker_index: int,
    faults: list[bool] | None,
    sum_: Callable[[Tensor], object],
) -> list[tuple[int, str, str]]:
    """Every worker's faults, learnt by every caller: ``[(rank, group name, kind)]``.

    ``sum_`` sums a ``[3, W]`` float table in place over the callers (one group, or every
    stepping worker), in which each worker sets its own column from ``faults`` (see
    :func:`local_faults`); the parameter server passes None. Workers of other
    groups contribute zeros, so the result lists only the callers' faults.
    """
    table = torch.zeros(len(KINDS), spec.n_workers)
    if faults is not None:
        table[:, worker_index] = torch.tensor(faults, dtype=table.dtype)
    sum_(table)
    found = []
    for index in range(spec.n_workers):
        rank = index + 1
        for kind, flag in zip(KINDS, table[:, index].tolist(), strict=True):
            if flag > 0:
                found.append((rank, spec.groups[spec.group_of(rank)].name, kind))
    return found


def describe(found: list[tuple[int, str, str]], *, epoch: int, step: int) -> str:
    """The reason: ``non-finite loss and gradient on rank 2 (group 'a') at epoch 0, step 7``.

    ``epoch`` is 0-based and ``step`` counts optimizer steps from 1, as in
    metrics and checkpoints (the faulty step would have completed as ``step``).
    """
    kinds: dict[tuple[int, str], list[str]] = {}
    for rank, name, kind in found:
        kinds.setdefault((rank, name), []).append(kind)
    where = "; ".join(
        f"{' and '.join(what)} on rank {rank} (group {name!r})"
        for (rank, name), what in kinds.items()
    )
    return f"non-finite {where or 'value (source not found)'} at epoch {epoch}, step {step}"
