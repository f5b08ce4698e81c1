"""Regrow: a shrunk task takes its whole request again at its next epoch end.

A task with `on_group_loss: shrink` that lost a group, and found no compatible group with
room, runs on the surviving groups (:func:`backend.scheduler.placement.survivors`). When a
group comes back, the task is taken in again at an epoch boundary: at the arrival of its
next epoch-end checkpoint (``epoch-<N>.pt``, which the engine writes at every epoch end;
``backend.tasks.reports.save_checkpoint`` calls :func:`at_epoch_end`), it restarts as a new
attempt booked on its whole request, which resumes from that checkpoint and starts epoch
N+1 on the new layout with fresh profiling (``worker.engine.session.start``).

The decision is made here only, once per epoch-end checkpoint, as one transaction under the
allocation lock (:func:`backend.scheduler.capacity.lock_allocation`): read the free workers
as they would be once the task released its own (``free_capacity(returned_by=...)``),
place the whole request (:func:`backend.scheduler.placement.plan`, never the survivors),
and only if it fits: the planned restart (:func:`backend.tasks.lifecycle.restart_planned`:
no alarm, not counted against `max_restarts`) and the booking of the new attempt
(:func:`backend.scheduler.booking.allocate`), committed together. No other scheduler can
book the returning group's workers in between, and a task that does not fit keeps running
shrunk, untouched, until its next epoch end. The scheduler's next pass publishes the new
attempt; its parameter server resumes from the task's newest epoch-end checkpoint
(:func:`backend.scheduler.dispatch.resume_checkpoint`), not from a step checkpoint the
shrunk attempt may still upload before it stops.

Never regrown: a task not shrunk (its placed workers are its requested workers), one whose
`on_group_loss` is not `shrink`, one not RUNNING in the checkpoint's attempt, and one at its
last epoch's end (it is finishing: nothing left to gain). A regrown task that loses a group
again shrinks again (the restart's usual path).
"""

import json
import logging
import re
from pathlib import Path

from sqlalchemy import update
from sqlalchemy.orm import Session

from backend.scheduler import capacity, placement
from backend.scheduler.booking import allocate
from backend.scheduler.queue import Queued
from backend.tasks import lifecycle
from backend.tasks.models import Checkpoint, Task, TaskStatus
from backend.tasks.spec import read_spec
from contracts.plan import ROUND_STRATEGIES
from contracts.task_spec import TaskSpec

log = logging.getLogger(__name__)

EPOCH_END = re.compile(r"epoch-(\d+)\.pt")
"""The name of an epoch-end checkpoint (``worker.engine.session``: ``epoch-{epoch}.pt``)."""


def epoch_end(checkpoint: Checkpoint) -> bool:
    """True for an epoch-end checkpoint (its file named ``epoch-<N>.pt``, N its epoch)."""
    found = EPOCH_END.fullmatch(Path(checkpoint.path).name)
    return found is not None and int(found.group(1)) == checkpoint.epoch


def shrunk(spec: TaskSpec) -> bool:
    """True when the task runs on fewer workers than it requested (a shrink drops whole
    groups; placement otherwise places every requested worker)."""
    return sum(g.workers for g in spec.groups) < sum(i.workers for i in spec.requested())


def may_regrow(task: Task, spec: TaskSpec, checkpoint: Checkpoint) -> bool:
    """The rules before capacity is read: a RUNNING task's epoch-end checkpoint of its
    current attempt, not its last epoch's, the task shrunk with `on_group_loss: shrink`."""
    return (
        task.status is TaskStatus.RUNNING
        and checkpoint.task_id == task.id
        and checkpoint.attempt == task.attempt
        and spec.on_group_loss == "shrink"
        # periodic and diloco keep one optimizer state per group, which a new layout cannot
        # take over
        and spec.sync_strategy not in ROUND_STRATEGIES
        and spec.epochs is not None
        and checkpoint.epoch + 1 < spec.epochs
        and epoch_end(checkpoint)
        and shrunk(spec)
    )


def at_epoch_end(session: Session, *, task: Task, checkpoint: Checkpoint) -> bool:
    """Take a shrunk task in again on its whole request at this (just stored) checkpoint,
    when it may (:func:`may_regrow`) and the whole request fits now; commits. Returns True
    if the task was restarted and its new attempt booked (else nothing changed)."""
    if not epoch_end(checkpoint) or not may_regrow(task, read_spec(task), checkpoint):
        return False  # (most checkpoints: not an epoch end, so no spec to read)
    capacity.lock_allocation(session)
    # Hold the task against other writers first: a cancellation, a finish or the monitor's
    # restart take no allocation lock. A guarded no-op update takes the row (PostgreSQL) or
    # the database's write lock (SQLite, whose reads lock nothing) until this transaction
    # ends, and finds nothing when the task is no longer this attempt's RUNNING task.
    held = session.execute(
        update(Task)
        .where(
            Task.id == task.id,
            Task.status == TaskStatus.RUNNING,
            Task.attempt == checkpoint.attempt,
        )
        .values(status=Task.status)
        .execution_options(synchronize_session=False)
    )
    if held.rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()
        return False
    # Read again under the locks: a claim or a finish may have changed the task since.
    locked = session.get(Task, task.id, populate_existing=True)
    spec = read_spec(locked) if locked is not None else None
    if locked is None or spec is None or not may_regrow(locked, spec, checkpoint):
        session.rollback()
        return False
    free = capacity.free_capacity(session, returned_by=locked.id)
    # The whole request afresh: no previous attempt to align with (its survivors, matched
    # by position, could put a named item on another group's place).
    chosen = placement.plan(spec.requested(), free, None)
    if chosen is None:
        session.rollback()
        log.info(
            "task %s: its whole request does not fit yet; stays shrunk after epoch %s",
            locked.id,
            checkpoint.epoch,
        )
        return False
    reason = f"{_returning(spec, chosen)}: taken in again from epoch {checkpoint.epoch + 1}"
    lifecycle.restart_planned(session, locked, reason)
    session.flush()  # PostgreSQL's booking is one statement on the driver's connection
    queued = Queued(locked.id, json.dumps(locked.spec), locked.attempt)
    if allocate(session, queued, chosen, free) is None:  # rolled back: nothing changed
        return False
    log.info("task %s: %s", locked.id, reason)
    return True


def _returning(spec: TaskSpec, chosen: placement.Plan) -> str:
    """What lets the task grow again, for its timeline: the groups it takes in."""
    running = {g.name for g in spec.groups}
    added = [g.name for g in chosen if g.name not in running]
    if not added:
        return "its whole request fits again"
    named = {item.name for item in spec.requested() if item.name}
    noun = "group" if len(added) == 1 else "groups"
    if set(added) <= named:
        return f"{noun} {', '.join(added)} {'is' if len(added) == 1 else 'are'} back"
    return f"{noun} {', '.join(added)} {'has' if len(added) == 1 else 'have'} room"
