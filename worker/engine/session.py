"""The training session every rank runs: start (resume or profile), epochs, epoch ends.

Order of collectives, the same on every rank:

1. parameters and buffers from the parameter server (:func:`sync_state`), then the resume
   package from the checkpoint (None on a fresh start);
2. fresh start: every worker profiles its throughput, and every rank picks
   the same initial shares (:class:`worker.engine.balance.Balancer`) from the
   same all-reduced rates, as at every rebalancing check
   (:func:`worker.engine.run.rebalance`); on resume the split state comes
   from the checkpoint; then the groups' gradients of one fixed batch are checked against
   the parameter server's (:func:`worker.engine.agreement.check_gradients`);
3. per epoch: the strategy's steps (:class:`worker.engine.strategy.Strategy`, the method of
   the rank's role), the final parameters and buffers (where rank 0 holds the model; where
   its owners do, every group holds it from the epoch's last round), validation, the
   epoch's measured work (re-measured throughput, epoch-level rebalance),
   the neighbour exchange, the epoch-end checkpoint (with the epoch's shard provenance,
   :mod:`worker.engine.provenance`, which the parameter server records without a collective),
   and only then the epoch's final progress report (so the platform's pace-based ETA,
   measured across an epoch's end, includes that work).

The session also finds the strategy a task names (:func:`strategy_for`), importing every
``strategy_*`` module of the package by name: it runs their epochs, so it stands above them
all (docs/architecture.md, "Training engine"); they build on the registry of
:mod:`worker.engine.strategy`.
"""

from __future__ import annotations

import ctypes
import importlib
import pkgutil
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch

from contracts import sharded_state
from contracts.plan import warm_point
from worker.engine import report
from worker.engine.agreement import check_gradients
from worker.engine.balance import Balancer
from worker.engine.compute import BusyClock, Work, profile_throughput
from worker.engine.contract import TrainingCode
from worker.engine.data import DataSources, Source
from worker.engine.distributed import Topology, broadcast_object
from worker.engine.emulation import Pace, SpeedEmulator
from worker.engine.exchange import gather_work, sum_over_world
from worker.engine.fsdp import load_state_rows, optimizer_params, purge_jemalloc, shard_state
from worker.engine.provenance import ShardLedger
from worker.engine.run import (
    MIN_WINDOW_STEPS,
    Run,
    checkpoint,
    counts_skips,
    pull_replica,
    rebalance,
    stepping,
    stepping_leaders,
    window_start,
)
from worker.engine.spec import RunSpec
from worker.engine.split import SplitState
from worker.engine.state import sync_state
from worker.engine.strategy import Strategy, defined

SKIPPED = "skipped_steps"


@cache
def _import_strategy_modules() -> None:
    """Import every ``strategy_*`` module of this package, once (defining registers)."""
    for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if module.name.startswith("strategy_"):
            importlib.import_module(f"{__package__}.{module.name}")


def registered() -> dict[str, type[Strategy[Any]]]:
    """Every strategy by name."""
    _import_strategy_modules()
    return defined()


def strategy_for(name: str) -> Strategy[Run]:
    """The strategy ``name`` selects; raises KeyError naming the known ones if none does."""
    strategies = registered()
    if name not in strategies:
        raise KeyError(f"unknown sync strategy {name!r}; known: {sorted(strategies)}")
    return strategies[name]()


def initial_shares(run: Run, train: Source | None) -> list[int]:
    """Fresh start: workers profile their samples/s, every rank picks the same shares from them.

    Every worker profiles at the even share first (within its cap, a group's
    ``max_local_batch``: :meth:`Balancer.profiling`). With the ``weighted``
    policy they profile once more, each at the share that first profile gave
    it, and the shares are chosen again from those rates: samples/s depends
    on the batch (a small batch costs more per sample, a large one may leave
    the cache), so a rate measured at the batch a worker will train with
    predicts its step time better (not under ``diloco``, whose groups take their samples
    in steps of the global batch: :attr:`Strategy.steps_at_share`). The rates
    reported are the last profile's.
    Profiling reads items of the worker's shard under the even split only
    (:meth:`worker.engine.split.SplitState.first_shard`), so a worker reads no
    item outside the block it starts from.
    """
    shares = run.balancer.profiling(run.topo.n_workers)  # even, within the workers' caps
    again = run.spec.split_policy == "weighted" and run.strategy.steps_at_share
    passes = 2 if again and run.topo.n_workers > 1 else 1
    for done in range(1, passes + 1):
        shares = _profiled_shares(run, train, shares, last=done == passes)
    return shares


def _profiled_shares(run: Run, train: Source | None, shares: list[int], *, last: bool) -> list[int]:
    """One profiling round: each worker measures its samples/s at its share in ``shares``;
    every rank learns all the rates and picks the same new shares from them."""
    spec, topo = run.spec, run.topo
    seconds, samples = 0.0, 0
    if not topo.is_ps:
        assert run.emulator is not None and train is not None
        share = shares[topo.worker_index]
        rate = profile_throughput(
            run.code,
            run.model,
            train,
            share,
            run.emulator,
            steps=spec.profile_steps,
            budget_s=spec.profile_budget_s,
            seed=spec.seed * 1000 + topo.rank,
            pool=run.split.first_shard(topo.worker_index, topo.n_workers, spec.seed),
        )
        if last:
            report.metric("profiled_samples_per_s", rate, step=0, epoch=0, rank=topo.rank)
        seconds, samples = (share / rate, share) if rate > 0 else (0.0, 0)
    compute_s, counts = gather_work(topo, seconds, samples)
    rates = [n / t if t > 0 else 0.0 for n, t in zip(counts, compute_s, strict=True)]
    proposal = run.balancer.initial(rates if all(rates) else [1.0] * len(rates))
    if last:  # the slowest worker's measured step; gathered, so every rank holds the same
        run.profiled_step_s = max(compute_s, default=0.0) or None
    if topo.is_ps:
        report.log(
            f"profiled samples/s {[round(r, 1) for r in rates]} at shares {shares}; "
            f"shares {proposal}"
        )
    return proposal


def keep_excluded(run: Run, package: dict[str, Any], shares: list[int]) -> list[int]:
    """The groups a checkpoint had left out for disagreeing (by name, those this run has)
    stay left out: returns ``shares`` without their workers (unchanged when none)."""
    names = set(package.get("excluded_groups") or [])
    groups = {g for g, plan in enumerate(run.spec.groups) if plan.name in names}
    if not groups:
        return shares
    run.excluded_groups |= groups
    if run.topo.is_ps:
        report.log(f"groups {sorted(names)} stay excluded (they disagreed before the restart)")
    return run.balancer.exclude({r - 1 for g in groups for r in run.spec.group_ranks(g)}, shares)


def restore(run: Run, package: dict[str, Any]) -> bool:
    """Resume from a checkpoint package; returns True when the epoch continues mid-way."""
    run.split = SplitState.from_state_dict(package["split"])
    shares = run.balancer.fit(keep_excluded(run, package, run.split.shares))  # within caps
    if shares != run.split.shares:
        run.split.set_shares(shares)
    run.step = int(package["step"])
    run.last_balance = run.last_checkpoint = run.last_progress = run.last_agreement = run.step
    run.epoch = int(package["epoch"]) + (1 if package["epoch_complete"] else 0)
    if not run.topo.is_ps:
        rng = (package["rng"] or {}).get(run.topo.rank)
        if rng is not None:
            torch.set_rng_state(rng)
        optimizers = package["group_optimizers"]
        if optimizers and run.optimizer is not None and run.strategy.group_optimizers:
            mine = optimizers[run.topo.group_index]
            if sharded_state.reference(mine) is not None:  # its state folder holds it
                load_state_rows(run.optimizer, mine, state_folder(run.spec, mine))
            else:  # a checkpoint from before state folders
                run.optimizer.load_state_dict(mine)
    report.log(f"rank {run.topo.rank} resumed at epoch {run.epoch}, step {run.step}")
    return not package["epoch_complete"]


def start(
    spec: RunSpec,
    code: TrainingCode,
    topo: Topology,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    data: DataSources,
    package: dict[str, Any] | None,
    clock: report.StartupClock | None = None,
) -> tuple[Run, bool]:
    """Steps 1-2 above. Returns the run and whether its first epoch is already under way.

    ``data`` gives the training set's item count (every rank) and, on compute workers,
    its source. ``clock`` (the rank's start-up so far) gets the parts from here to the
    first step (``setup``: the optimizer and the rest of the rank's own preparation;
    ``sync``: the parameter server's model; ``profile``; ``agreement``) and reports them."""
    if clock is not None:
        clock.mark("setup")
    pace = Pace(spec.emulation_pace) if spec.emulation_pace else None
    emulator = (
        None if topo.is_ps else SpeedEmulator(spec.speed_factor_of(topo.rank), topo.device, pace)
    )
    balancer = Balancer(spec.split_policy, spec.global_batch_size, caps=spec.local_batch_caps)
    train = data.train
    placeholder = SplitState(data.n_train, spec.global_batch_size, [], [], [])
    strategy = strategy_for(spec.sync_strategy)
    run = Run(
        spec,
        code,
        topo,
        model,
        optimizer,
        placeholder,
        balancer,
        train,
        emulator,
        strategy=strategy,
    )
    if topo.is_ps:
        run.ledger = ShardLedger(spec)
    sync_state(topo, run.state, spec=spec)
    if clock is not None:
        clock.mark("sync")
    package = broadcast_object(package, topo)
    replica = package is not None and run.strategy.replicated and not topo.is_ps
    if replica and optimizer is not None and package["optimizer"] is not None:
        saved = package["optimizer"]
        if sharded_state.reference(saved) is not None:  # each worker reads what it holds
            load_state_rows(optimizer, saved, state_folder(spec, saved))
        else:  # a sharded worker keeps its rows of a whole state
            mine = shard_state(saved, optimizer_params(optimizer)) if run.sharded else saved
            optimizer.load_state_dict(mine)
    if package is not None and fits(package, run):
        under_way = restore(run, package)
    elif package is not None and continues(package, run):
        under_way = continue_epoch(run, package, train)
    else:
        if package is not None:
            # Another layout (e.g. a restart on other groups): keep the model, redo the epoch.
            run.epoch = int(package["epoch"]) + (1 if package["epoch_complete"] else 0)
            run.step = run.last_progress = run.last_agreement = int(package["step"])
            run.last_balance = run.last_checkpoint = run.step  # the marks count from here
            report.log(
                f"checkpoint split does not fit this layout; epoch {run.epoch} from its start"
            )
        shares = initial_shares(run, train)
        if package is not None:  # groups left out for disagreeing stay out on the new layout
            shares = keep_excluded(run, package, shares)
        run.split = SplitState.initial(data.n_train, shares, spec.seed)
        under_way = False
    if clock is not None:
        clock.mark("profile")
    check_gradients(run, train)
    if clock is not None:
        clock.mark("agreement")
        clock.report(topo.rank)
    return run, under_way


def state_folder(spec: RunSpec, outlined: dict[str, Any]) -> Path:
    """Where this rank reads a state folder of the resume checkpoint (named in ``outlined``,
    an optimizer outline): in ``spec.resume_state_dir`` where given (an agent downloads the
    checkpoint's state folders into the rank's own directory), else beside
    ``spec.resume_from``. Raises FileNotFoundError naming the folder where neither holds it."""
    ref = sharded_state.reference(outlined) or {}
    if spec.resume_state_dir:
        folder = Path(spec.resume_state_dir) / str(ref.get("folder"))
    elif spec.resume_from:
        folder = Path(spec.resume_from).parent / str(ref.get("folder"))
    else:
        folder = Path(str(ref.get("folder")))
    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(
            f"the checkpoint's sharded optimizer state {ref.get('folder')!r} is not at {folder}"
        )
    return folder


def fits(package: dict[str, Any], run: Run) -> bool:
    """True when the checkpoint's split state matches this run's workers, batch and data."""
    split = package["split"]
    return (
        split is not None
        and len(split["shares"]) == run.topo.n_workers
        and int(split["batch"]) == run.spec.global_batch_size
        and int(split["n_items"]) == run.split.n_items
        and (
            package["group_optimizers"] is None
            or len(package["group_optimizers"]) == len(run.spec.groups)
        )
    )


def continues(package: dict[str, Any], run: Run) -> bool:
    """True when a checkpoint from another layout (other workers) can go on with its epoch:
    taken inside the epoch, same global batch and data, and no per-group optimizer state
    (``periodic`` keeps one per group, which another set of groups cannot take over)."""
    split = package["split"]
    return (
        split is not None
        and not package["epoch_complete"]
        and package["group_optimizers"] is None
        and int(split["batch"]) == run.spec.global_batch_size
        and int(split["n_items"]) == run.split.n_items
    )


def continue_epoch(run: Run, package: dict[str, Any], train: Source | None) -> bool:
    """Resume a checkpoint of another layout at its step (a restart on fewer or other
    workers): the new workers profile their throughput, every rank picks the same shares
    from it, and the samples the epoch has not taken yet are split for those shares
    (:meth:`worker.engine.split.SplitState.regrouped`). The model and (replicated)
    optimizer come from the checkpoint; the workers' random states do not (other ranks).
    Returns True: the epoch is under way."""
    old = SplitState.from_state_dict(package["split"])
    run.epoch = int(package["epoch"])
    run.step = int(package["step"])
    run.last_balance = run.last_checkpoint = run.last_progress = run.last_agreement = run.step
    run.split = old.regrouped(keep_excluded(run, package, initial_shares(run, train)))
    if run.topo.is_ps:
        report.log(
            f"checkpoint from {old.n_workers} workers: continues epoch {run.epoch} at step "
            f"{old.step} of {old.steps_per_epoch} on {run.topo.n_workers} workers, "
            f"{sum(run.split.needs_from(old.step))} samples left, shares {run.split.shares}"
        )
    return True


def end_epoch(run: Run, val_totals: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Step 3's collectives after the last step; returns validation sums, every worker's work
    and the epoch's ``skipped_steps`` (summed with the validation sums, no collective of its own).
    """
    if run.strategy.replicated:
        # The replicas are the same bits on one kind of device, but optimizer kernels of
        # different devices (a CUDA group beside CPU groups) round differently: once an epoch
        # every worker takes the first worker's model again, through the parameter server.
        pull_replica(run)
    # A parked group takes the model when taken back (run.refresh, catch_up). Where the owners
    # hold the model in slices, every group took it whole from the epoch's last round.
    if stepping(run) and not run.spec.model_in_slices:
        sync_state(run.topo, run.state, stepping_leaders(run), run.spec)
    counted = {SKIPPED: (float(run.skipped), 1.0)} if counts_skips(run) else {}
    val = sum_over_world({**val_totals, **counted}, run.topo)
    skipped = int(val.pop(SKIPPED, (0.0, 0.0))[0])
    compute_s, samples = gather_work(run.topo, run.epoch_work.compute_s, run.epoch_work.samples)
    if run.spec.split_policy == "weighted":
        # The latest window (the steps since the last check), as at every other check: the
        # whole epoch would mix in how fast the workers were before a change of speed. A
        # window of a few steps only (a check just before the epoch's end) is too noisy:
        # then the epoch. Every rank knows the steps, so all take the same one.
        recent = run.step - window_start(run) >= MIN_WINDOW_STEPS
        # The epoch's steps are in the rate estimate already: decide on it, do not blend
        # them in again (a speed change mid-epoch would be pulled back to the old speed).
        # An epoch that holds the attempt's first steps (warm) decides on no such fallback:
        # it began (global step run.step - split.step) before the warm point.
        cold = run.warm_at is not None and run.step - run.split.step < run.warm_at
        if recent or not cold:
            rebalance(run, run.window if recent else run.epoch_work, update=recent)
    run.window, run.last_balance = Work(), run.step
    if run.ledger is not None:  # the samples each worker took, before the exchange moves them
        run.ledger.close(run.split, epoch=run.epoch, step=run.step)
    sent = run.split.exchange(run.spec.exchange_fraction, run.spec.seed, run.epoch)
    if run.topo.is_ps and any(sent):
        report.log(f"epoch {run.epoch}: neighbour exchange sent {sent} samples")
    return {"val": val, "compute_s": compute_s, "samples": samples, "skipped_steps": skipped}


def release_freed_memory() -> None:
    """Give the heap memory freed so far back to the system (glibc ``malloc_trim``, or
    jemalloc's arenas purged where a sharded worker runs on it, :func:`fsdp.purge_jemalloc`).

    An epoch's start replaces the split's index tensors (4 bytes per item, e.g. 33 MB for
    8 million items); glibc keeps such freed blocks in the heap, so without this the
    worker's memory would carry every copy it ever made. A no-op where neither is there.
    """
    if purge_jemalloc():
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def train(
    run: Run,
    under_way: bool,
    validate: Callable[[Run], dict[str, tuple[float, float]]],
    report_epoch: Callable[[Run, dict[str, Any], float], None],
) -> None:
    """Run every remaining epoch; ``validate`` and ``report_epoch`` are the role's own parts."""
    strategy = run.strategy
    reported = time.perf_counter()
    for epoch in range(run.epoch, run.spec.epochs):
        run.epoch = epoch
        if not under_way:
            run.split.begin_epoch(run.spec.seed, epoch)
            release_freed_memory()
        under_way = False
        if run.warm_at is None and run.guard is not None:  # the second sync point, from
            # which the guard measures (contracts.plan.warm_point)
            split = run.split
            run.warm_at = warm_point(
                run.step, split.step, split.steps_per_epoch, run.spec.sync_period
            )
        if run.ledger is not None:
            run.ledger.begin(run.split, run.step)
        run.epoch_work, run.loss_sum, run.samples, run.stats = Work(), 0.0, 0, {}
        run.clock = BusyClock()  # the first section follows the epoch's end: not sustained
        run.window.opened = time.perf_counter()  # its wall time counts from the first step
        every = report.step_every(run.spec.step_metrics_every, run.split.steps_per_epoch)
        run.curve.restart(run.step, every)  # the per-step series' window (report.StepCurve)
        run.skipped = 0
        started = time.perf_counter()
        try:
            (strategy.server_epoch if run.topo.is_ps else strategy.worker_epoch)(run)
        finally:
            run.curve.flush()  # the epoch's last points, or those before a failure
        seconds = time.perf_counter() - started
        run.window.closed = time.perf_counter()  # the epoch's end is not the window's steps
        results = end_epoch(run, validate(run))
        now = time.perf_counter()
        results["epoch_wall_s"], reported = now - reported, now
        report_epoch(run, results, seconds)
        checkpoint(run, f"epoch-{epoch}.pt", epoch_complete=True)
        if strategy.reports_progress(run.topo):  # the epoch's work is done, its end included
            report.progress(
                epoch=epoch,
                step=run.step,
                steps_per_epoch=run.split.steps_per_epoch,
                epochs=run.spec.epochs,
            )
        run.last_progress = run.step  # the next report counts its steps from here
