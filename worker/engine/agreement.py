"""Cross-device agreement: every group computes what the parameter server computes.

Groups of different hardware (CPU, GPUs of several generations, NPUs) run different
kernels, so their numbers may differ; a broken device, a driver that silently computes in
reduced precision or a wrong build would otherwise corrupt the shared model unnoticed.
Two checks, both collectives every rank takes at steps every rank knows:

1. **Before training** (:func:`check_gradients`), after the split is set: the first worker
   reads one fixed batch (the first ``AGREEMENT_BATCH`` items of its first shard) and
   broadcasts it; every group leader and the parameter server compute the gradient of the
   user's loss on it from the same parameters, in eval mode (no dropout, BatchNorm on its
   running statistics, buffers unchanged), and the parameter server compares each group's
   gradient ``g`` (``[P]``) with its own ``r``, first by a digest of their bits; only a
   group whose digest differs (and only when the server has its own ``r``) sends ``g``,
   compared by the distance below.
2. **During training** (:func:`check_parameters`), where every worker steps a replica of
   one model (``sync``), every ``agreement_every`` steps at a control point: every group
   leader computes a float64 checksum of its replica (``[3]``: sum, sum of squares and a
   position-weighted sum, so a swap of values shows; the distance below is taken between
   checksums); one allreduce gives every rank the table. The reference is group 0's
   replica, the one the parameter server takes its model from; when every other group (two
   or more) differs from it, group 0 is named and the task fails (the model's source cannot
   be left out). ``periodic`` groups train apart between averages by design and load the
   same average at each, and ``quorum`` groups hold different versions by design: only
   check 1 applies to them. Members other than a group's leader step the same replica on
   the same group sum and are not checked.

Check 1 runs inside :func:`shared_randomness` (every rank seeded alike, its own random
state untouched, so a stochastic loss agrees and a resumed run stays exact). Training code
that cannot run on the parameter server's CPU skips check 1, logged.

A group disagrees when ``||g - r||_2 / ||r||_2`` exceeds the tolerance of its device type
paired with the reference's (the parameter server's CPU for check 1, group 0's device for
check 2) (:data:`contracts.plan.DEFAULT_AGREEMENT_TOLERANCE`:
bit for bit for CPU with CPU, else ``OTHER_PAIR_TOLERANCE`` = 1e-4; per task
``agreement_tolerance``). The parameter server reports an ``alarm`` event naming the group,
its device type, the distance and the tolerance; then with ``on_disagreement: fail`` every
rank raises :class:`DisagreementError`, with ``exclude`` the group's workers get a share of
0 from then on (:meth:`worker.engine.balance.Balancer.exclude`; they still take part in the
collectives, with no samples) and are not checked again. ``off`` skips both checks.

This is the redundant-computation check of result verification in heterogeneous and
volunteer computing (e.g. Sarmenta, "Sabotage-Tolerance Mechanisms for Volunteer Computing
Systems", FGCS 2002), applied to one batch and to parameter checksums.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from contracts.plan import (
    AGREEMENT_BATCH,
    BFLOAT16_TOLERANCE,
    DEFAULT_AGREEMENT_TOLERANCE,
    OTHER_PAIR_TOLERANCE,
    pair_key,
)
from worker.engine import report
from worker.engine.balance import Balancer
from worker.engine.compute import batch_loss
from worker.engine.contract import TrainingCode
from worker.engine.data import Source, TensorData
from worker.engine.distributed import FIRST_WORKER, Topology, all_reduce_sum, broadcast_object
from worker.engine.exchange import receive_at_ps, send_to_ps
from worker.engine.sharded import full, materialised
from worker.engine.spec import RunSpec
from worker.engine.split import SplitState
from worker.engine.strategy import Strategy

PS_DEVICE_TYPE = "cpu"
"""The parameter server computes on the CPU."""

BFLOAT16_HOOK = "POLYTRAIN_TEST_BFLOAT16_GROUP"
"""Test hook: the group of this name runs its forward passes under bfloat16 autocast, as a
device that silently computes in reduced precision would."""


class DisagreementError(RuntimeError):
    """A group's numbers differ from the parameter server's beyond the tolerance."""


class CheckedRun(Protocol):
    """The part of a rank's training state (:class:`worker.engine.run.Run`) that the checks
    read and change, stated here: the run calls :func:`check_parameters` at its control
    points, so this module stands below it and does not import it."""

    spec: RunSpec
    code: TrainingCode
    topo: Topology
    model: torch.nn.Module
    split: SplitState
    balancer: Balancer
    strategy: Strategy[Any]
    step: int
    agreement_s: float
    excluded_groups: set[int]

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The model's parameters in flat-vector order."""

    @property
    def parked_groups(self) -> frozenset[int]:
        """The groups the guard parked (:mod:`worker.engine.guard`): off the step path, their
        replicas wait at the step they were parked."""


def tolerance(run: CheckedRun, group: int, against: str = PS_DEVICE_TYPE) -> float:
    """The relative L2 distance allowed between group ``group`` and a reference computed on
    ``against`` (the parameter server's CPU by default): the task's or the default for the
    pair of device types, and at least :data:`contracts.plan.BFLOAT16_TOLERANCE` for a
    sharded group computing in bfloat16 (``fsdp_param_dtype``)."""
    key = pair_key(run.spec.groups[group].device_type, against)
    given = run.spec.agreement_tolerance
    allowed = given.get(key, DEFAULT_AGREEMENT_TOLERANCE.get(key, OTHER_PAIR_TOLERANCE))
    if run.spec.sharded(group) and run.spec.fsdp_param_dtype == "bfloat16":
        return max(allowed, BFLOAT16_TOLERANCE)
    return allowed


def distance(value: Tensor | Sequence[Tensor], reference: Tensor | Sequence[Tensor]) -> float:
    """``||value - reference||_2 / ||reference||_2`` in float64, over one tensor or over the
    concatenation of matching tensors (e.g. per-parameter gradients, without concatenating
    them): 0 for identical bits (checked first, in the tensors' own dtype); the absolute
    distance when the reference is zero. A reference that is not finite cannot be compared
    with (0: the training's own non-finite check reports it); a value that is not finite
    beside a finite reference is infinitely far."""
    values = [value] if isinstance(value, Tensor) else list(value)
    references = [reference] if isinstance(reference, Tensor) else list(reference)
    pairs = list(zip(values, references, strict=True))
    if all(torch.equal(v, r) for v, r in pairs):
        return 0.0
    if not all(bool(r.isfinite().all()) for r in references):
        return 0.0
    if not all(bool(v.isfinite().all()) for v in values):
        return math.inf
    gap = sum(float((v.double() - r.double()).square().sum()) for v, r in pairs)
    scale = sum(float(r.double().square().sum()) for r in references)
    return math.sqrt(gap / scale) if scale > 0 else math.sqrt(gap)


def disagrees(run: CheckedRun, group: int, gap: float, against: str = PS_DEVICE_TYPE) -> bool:
    """True when ``gap`` exceeds group ``group``'s tolerance against a reference computed on
    ``against`` (exact: any difference)."""
    return gap > tolerance(run, group, against)


@contextmanager
def shared_randomness(run: CheckedRun) -> Iterator[None]:
    """Every rank draws the same random numbers inside (a stochastic loss or transform gives
    the same result on each), and none of them counts: the rank's random state (CPU, and
    its CUDA device's) is as before afterwards, so a resumed run stays exact."""
    device = run.topo.device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(run.spec.seed)
        yield


@contextmanager
def hooked_precision(run: CheckedRun) -> Iterator[None]:
    """The bfloat16 test hook (:data:`BFLOAT16_HOOK`) on this rank's group, else nothing."""
    hooked = os.environ.get(BFLOAT16_HOOK)
    group = run.topo.group_index if hooked else None
    if group is not None and run.spec.groups[group].name == hooked:
        with torch.autocast(device_type=run.topo.device.type, dtype=torch.bfloat16):
            yield
    else:
        yield


def _fixed_batch(run: CheckedRun, train: Source | None) -> Any:
    """The first worker's first ``AGREEMENT_BATCH`` items of its first shard, on every rank."""
    batch = None
    if run.topo.rank == FIRST_WORKER:
        assert train is not None
        pool = run.split.first_shard(0, run.topo.n_workers, run.spec.seed)
        indices = pool[:AGREEMENT_BATCH].to(torch.int64)
        if not train.expects(indices):
            train.plan([indices])
        batch = train.take(indices)
    return broadcast_object(batch, run.topo, src=FIRST_WORKER)


def _backward(run: CheckedRun, batch: Any) -> None:
    """The user's loss (the batch mean) on ``batch`` and its backward, in eval mode, the
    gradients left in the parameters; the model's mode and buffers are as before; the caller
    clears the gradients (``zero_grad``) once it has used them. In a sharded group the
    leader's loss counts once and the others' are scaled by 0, so the group's summed
    gradient is the leader's bit for bit."""
    data = TensorData.from_batch(batch)
    model, was_training = run.model, run.model.training
    model.eval()
    try:
        model.zero_grad(set_to_none=True)
        with hooked_precision(run):
            loss = batch_loss(run.code, model, data, torch.arange(len(data)), run.topo.device)
            (loss if run.topo.am_i_leader or run.topo.is_ps else loss * 0.0).backward()
    finally:
        model.train(was_training)


def _each_gradient(run: CheckedRun) -> Iterator[Tensor]:
    """The gradients :func:`_backward` left, whole, per parameter in flat-vector order
    (``[numel_i]`` each, on the rank's device; zeros for a parameter the loss does not
    reach); a sharded parameter's gathered over its group when its turn comes (every member
    iterates alike)."""
    for p in run.params:
        if p.grad is not None:
            yield full(p.grad).detach().reshape(-1)
        else:
            yield torch.zeros(p.shape, dtype=p.dtype, device=p.device).reshape(-1)


def _gradients(run: CheckedRun, batch: Any) -> list[Tensor]:
    """This rank's gradient of the user's loss on ``batch`` (:func:`_backward`), per
    parameter in flat-vector order (:func:`_each_gradient`), all at once."""
    _backward(run, batch)
    return list(_each_gradient(run))


def check_gradients(run: CheckedRun, train: Source | None) -> None:
    """Check 1 above, on every rank (collectives over the groups and the leaders'); its
    wall seconds count to ``run.agreement_s`` (every rank waits in it: all of it is cost)."""
    if run.spec.on_disagreement == "off":
        return
    started = time.perf_counter()
    try:
        _check_gradients(run, train)
    finally:
        run.agreement_s += time.perf_counter() - started


def _check_gradients(run: CheckedRun, train: Source | None) -> None:
    """Each leader first sends a SHA-256 digest of its gradient's bytes (:func:`digest`) and
    the server answers whether it wants the gradient itself: only when the digests differ
    (identical bits are at distance 0, whatever the tolerance) and the server has its own
    reference. A clean CPU run so moves 32 bytes per group, not the model's size; a group
    that differs sends its gradient parameter by parameter (no flat copy), which the server
    receives into a buffer and compares (:func:`distance`). Training code that cannot run
    on the parameter server's CPU (e.g. it calls ``.cuda()``) skips the comparison, logged,
    rather than failing a task that would train."""
    topo = run.topo
    with shared_randomness(run):
        batch = _fixed_batch(run, train)
        # Each group's distance where it disagrees, NaN elsewhere: one broadcast.
        gaps = torch.full((len(run.spec.groups),), math.nan, dtype=torch.float64)
        if topo.is_ps:
            try:
                reference: list[Tensor] | None = _gradients(run, batch)
            except Exception as exc:  # the user's code, on a device it was not written for
                reference = None
                report.log(
                    "agreement check before training skipped: the training code did not run "
                    f"on the parameter server's CPU ({type(exc).__name__}: {str(exc)[:300]})"
                )
            mine = digest(reference) if reference is not None else None
            shapes = [(p.numel(), p.dtype) for p in run.params]
            for group, leader in enumerate(run.spec.leader_ranks()):
                theirs = receive_at_ps(topo, DIGEST_BYTES, torch.uint8, leader)
                wanted = mine is not None and not torch.equal(theirs, mine)
                dist.send(torch.tensor([int(wanted)], dtype=torch.uint8), leader, topo.link(leader))
                if reference is not None and wanted:
                    received = [receive_at_ps(topo, n, dtype, leader) for n, dtype in shapes]
                    gap = distance(received, reference)
                    if disagrees(run, group, gap):
                        gaps[group] = gap
        elif topo.am_i_leader or run.spec.sharded(topo.group_index):
            _send_gradients(run, batch)
    run.model.zero_grad(set_to_none=True)
    gaps = broadcast_object(gaps, topo)
    found = {g: gap for g, gap in enumerate(gaps.tolist()) if not math.isnan(gap)}
    act(run, found, "its gradient of a fixed batch")


def _send_gradients(run: CheckedRun, batch: Any) -> None:
    """A group leader's side of check 1 (with the other members of a sharded group): the
    digest of its gradient of ``batch``, then the gradient itself when the server asks.
    A sharded group gathers the gradient a parameter at a time, for the digest and again
    for the sending (the leader tells its members whether it was asked), so no member holds
    the whole gradient."""
    topo = run.topo
    if not run.spec.sharded(topo.group_index):
        gradients = _gradients(run, batch)
        send_to_ps(topo, digest(gradients))
        asked = torch.zeros(1, dtype=torch.uint8)
        dist.recv(asked, 0, topo.link(0))
        if asked.item():
            for grad in gradients:
                send_to_ps(topo, grad)
        return
    _backward(run, batch)
    if topo.am_i_leader:
        send_to_ps(topo, digest(_each_gradient(run)))
    else:
        for _ in _each_gradient(run):  # the gathers need every member
            pass
    asked = torch.zeros(1, dtype=torch.uint8)
    if topo.am_i_leader:
        dist.recv(asked, 0, topo.link(0))
    told = asked.to(topo.device)  # the group's own backend: nccl on a CUDA group
    dist.broadcast(told, src=topo.group_ranks[0], group=topo.group)
    asked = told.cpu()
    if asked.item():
        for grad in _each_gradient(run):
            if topo.am_i_leader:
                send_to_ps(topo, grad)


DIGEST_BYTES = 32


def digest(tensors: Iterable[Tensor]) -> Tensor:
    """SHA-256 of the tensors' bytes, in order (``[32]`` uint8, CPU): equal digests mean the
    same bits (a collision is not a concern against faulty hardware, which is not trying)."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        hasher.update(flat.view(torch.uint8).numpy().data)
    return torch.frombuffer(bytearray(hasher.digest()), dtype=torch.uint8)


CHECKSUM_PERIOD = 1021
"""The position weights of the checksum repeat every this many values (a prime)."""

_CHUNK = 1 << 20


def checksum(params: Iterable[Tensor]) -> Tensor:
    """``[sum, sum of squares, sum of w_i x_i]`` over the parameters' values ``x_i`` in
    flat-vector order, with ``w_i = 1 + i mod CHECKSUM_PERIOD``, in float64 (``[3]``, CPU).

    Computed a chunk of ``_CHUNK`` values at a time in float64, so the temporary memory
    stays a few MB whatever the model's size; the weights of a chunk are a slice of one
    cached ramp (:func:`_ramp`)."""
    total = torch.zeros(3, dtype=torch.float64)
    offset = 0
    with torch.no_grad():
        for param in params:
            flat = param.detach().reshape(-1)
            ramp = _ramp(flat.device)
            for start in range(0, flat.numel(), _CHUNK):
                part = flat[start : start + _CHUNK].double()
                shift = offset % CHECKSUM_PERIOD
                weights = ramp[shift : shift + len(part)]
                total += torch.stack([part.sum(), part.dot(part), part.dot(weights)]).cpu()
                offset += len(part)
    return total


_RAMPS: dict[tuple[torch.device, int], Tensor] = {}


def _ramp(device: torch.device) -> Tensor:
    """``1 + k mod CHECKSUM_PERIOD`` for ``k < _CHUNK + CHECKSUM_PERIOD`` (float64, on
    ``device``, built once): chunk weights starting at any position are one slice of it."""
    key = (device, _CHUNK)
    if key not in _RAMPS:  # one period repeated (a float remainder over 1M values took 12 ms)
        period = torch.arange(1, CHECKSUM_PERIOD + 1, dtype=torch.float64, device=device)
        repeats = -(-(_CHUNK + CHECKSUM_PERIOD) // CHECKSUM_PERIOD)
        _RAMPS[key] = period.repeat(repeats)[: _CHUNK + CHECKSUM_PERIOD]
    return _RAMPS[key]


def check_parameters(run: CheckedRun) -> None:
    """Check 2 above, on every rank, for strategies whose workers step replicas of one model
    (``sync``): one float64 allreduce of a ``[G, 4]`` table (row ``g`` group ``g``'s
    leader's checksum and the seconds it took); every rank then takes the same decision
    from it. The reference is the replica the parameter server takes its model from: group
    0's, or the first group's the guard has not parked (a parked group's replica is not
    compared: it waits at the step it was parked); when every other group (two or more)
    disagrees with it, the reference is the one named, and the task fails (the model's
    source cannot be left out). The slowest checksum's seconds count to
    ``run.agreement_s``: the check's own work on the step's path (a wait for a rank still
    finishing its step is not the check's)."""
    spec = run.spec
    if spec.on_disagreement == "off" or not spec.agreement_every or not run.strategy.replicated:
        return
    topo, groups = run.topo, len(spec.groups)
    table = torch.zeros(groups, 4, dtype=torch.float64)
    if (topo.am_i_leader or run.spec.sharded(topo.group_index)) and topo.group_index is not None:
        started = time.perf_counter()
        mine = checksum(materialised(run.params))  # a sharded group's members gather it
        if topo.am_i_leader:
            table[topo.group_index, :3] = mine
            table[topo.group_index, 3] = time.perf_counter() - started
    all_reduce_sum(table, topo)
    run.agreement_s += float(table[:, 3].max())
    out = run.parked_groups
    stepping = [g for g in range(groups) if g not in out]
    ref = ([g for g in stepping if g not in run.excluded_groups] or stepping)[0]
    source = spec.groups[ref].device_type
    others = [g for g in range(groups) if g != ref and g not in out | run.excluded_groups]
    found = {
        g: gap
        for g in others
        if disagrees(run, g, gap := distance(table[g, :3], table[ref, :3]), source)
    }
    what = f"its parameters' checksum at step {run.step}"
    if len(others) >= 2 and set(found) == set(others):
        gap = min(found.values())
        act(run, {ref: gap}, f"{what} (every other group's differs from it)", fail=True)
    act(run, found, what, against=(spec.groups[ref].name, source))


def act(
    run: CheckedRun,
    found: dict[int, float],
    what: str,
    *,
    against: tuple[str, str] | None = None,
    fail: bool = False,
) -> None:
    """Alarm for every group in ``found`` (group index: distance), then fail or exclude.
    ``against``: the reference's ``(name, device type)`` when it is not the parameter server
    (a group's replica); ``fail``: fail whatever ``on_disagreement`` says.

    Raises DisagreementError (every rank) with ``on_disagreement: fail`` or ``fail``, or
    when excluding would leave no worker.
    """
    found = {g: gap for g, gap in found.items() if g not in run.excluded_groups}
    if not found:
        return
    name, device = against if against else ("the parameter server", PS_DEVICE_TYPE)
    if against:
        name = f"group {name!r}"
    reasons = []
    for group, gap in sorted(found.items()):
        plan = run.spec.groups[group]
        reason = (
            f"group {plan.name!r} ({plan.device_type}) disagrees with {name} ({device}): "
            f"{what} is {gap:.3g} away (relative L2), tolerance "
            f"{tolerance(run, group, device):g} for "
            f"{pair_key(plan.device_type, device)}"
        )
        reasons.append(reason)
        if run.topo.is_ps:
            report.alarm(reason, group=plan.name)
    if fail or run.spec.on_disagreement == "fail":
        why = "the model's source cannot be left out" if fail else "on_disagreement: fail"
        raise DisagreementError("; ".join(reasons) + f" ({why})")
    workers = {r - 1 for g in found for r in run.spec.group_ranks(g)}
    try:
        shares = run.balancer.exclude(workers, run.split.shares)
    except ValueError as exc:
        raise DisagreementError("; ".join(reasons) + f": {exc}") from None
    run.excluded_groups |= set(found)
    if run.topo.is_ps:
        names = ", ".join(repr(run.spec.groups[g].name) for g in sorted(found))
        report.log(f"excluded {names} (on_disagreement: exclude): shares {shares}")
    run.split.set_shares(shares)
