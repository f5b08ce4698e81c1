"""What agents report besides a task's fate: log lines, metrics, progress, checkpoints and
the ranks they saw alive, with their resource use (and its alarm)."""

import logging
import os
import tempfile
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import select, tuple_, update
from sqlalchemy.orm import Session, lazyload

from backend.core.db import utcnow
from backend.core.errors import Conflict, Invalid
from backend.scheduler import regrow
from backend.tasks import lifecycle
from backend.tasks.models import (
    ACTIVE,
    RESOURCE_METRICS,
    Allocation,
    Checkpoint,
    EventKind,
    LogLine,
    Metric,
    NodeRole,
    Task,
    TaskEvent,
    next_pace,
)
from backend.tasks.spec import read_spec
from contracts import sharded_state
from contracts.agent_api import (
    CHECKPOINT_NAME,
    Alarm,
    LogBatch,
    LogIn,
    MetricBatch,
    MetricIn,
    Progress,
    RankSample,
    Report,
    RunningRanks,
)
from contracts.payload import TaskLimits

if TYPE_CHECKING:
    from backend.agents.stamps import HeldStamps

log = logging.getLogger(__name__)
MEMORY_ALARM_FRACTION = 0.9
"""A rank whose resident memory reaches this part of its `memory_limit_mb` raises an alarm."""


def add_report(session: Session, *, task: Task, report: Report) -> int:
    """Store a reporter's log lines, metrics and progress together, in one transaction
    (each as `add_logs`, `add_metrics` and `set_progress` would); the new lines' count."""
    stored = _stage_logs(session, task_id=task.id, lines=report.lines)
    _stage_metrics(session, task_id=task.id, metrics=report.metrics)
    if report.progress is not None:
        _stage_progress(task, report.progress)
    session.commit()
    return stored


def add_logs(session: Session, *, task_id: int, batch: LogBatch) -> int:
    """Store log lines; a line already stored (same node and seq) is skipped."""
    stored = _stage_logs(session, task_id=task_id, lines=batch.lines)
    session.commit()
    return stored


def _stage_logs(session: Session, *, task_id: int, lines: list[LogIn]) -> int:
    """Add the lines not stored yet (by attempt, node and seq) to the session; their count."""
    return _stage_numbered(session, LogLine, task_id=task_id, items=lines)


def _stage_numbered(
    session: Session,
    model: type[LogLine] | type[Metric],
    *,
    task_id: int,
    items: Sequence[LogIn] | Sequence[MetricIn],
) -> int:
    """Add `items` as `model` rows of task `task_id` to the session, each numbered one
    (attempt, node and seq) once: not when stored already (a report sent again after its
    answer was lost), nor twice from one report (which the unique key would make a 500);
    an unnumbered one (`seq` None: a metric of an older agent) always. Their count."""
    keys = {(i.attempt, i.node, i.seq) for i in items if i.seq is not None}
    stored: set[tuple[Any, ...]] = set()
    if keys:
        stored = {
            tuple(row)
            for row in session.execute(
                select(model.attempt, model.node, model.seq).where(
                    model.task_id == task_id,
                    tuple_(model.attempt, model.node, model.seq).in_(list(keys)),
                )
            )
        }
    new = []
    for item in items:
        key = (item.attempt, item.node, item.seq)
        if item.seq is None or key not in stored:
            new.append(model(task_id=task_id, **item.model_dump()))
            if item.seq is not None:
                stored.add(key)
    session.add_all(new)
    return len(new)


def add_metrics(session: Session, *, task_id: int, batch: MetricBatch) -> None:
    """Store metric values; a numbered one already stored (same attempt, node and seq) is
    skipped."""
    _stage_metrics(session, task_id=task_id, metrics=batch.metrics)
    session.commit()


def _stage_metrics(session: Session, *, task_id: int, metrics: list[MetricIn]) -> None:
    """Add the values not stored yet to the session: a numbered value (`MetricIn.seq`) once
    by attempt, node and seq, as `_stage_logs` does for lines (a report sent again after its
    answer was lost stored its metrics twice); an unnumbered one always."""
    _stage_numbered(session, Metric, task_id=task_id, items=metrics)


def set_progress(session: Session, *, task: Task, data: Progress) -> None:
    """Store a progress report and move the attempt's measured pace (`Task.finish_estimate`)
    as :func:`backend.tasks.models.next_pace` says. A report of an earlier attempt (sent
    late, after a restart) is ignored."""
    _stage_progress(task, data)
    session.commit()


def _stage_progress(task: Task, data: Progress) -> None:
    """`set_progress` without the commit."""
    if data.attempt is not None and data.attempt != task.attempt:
        return
    now = utcnow()
    start, mark = next_pace(
        _pair(task.pace_start_at, task.pace_start_progress),
        _pair(task.pace_epoch_at, task.pace_epoch_progress),
        (now, data.progress),
        new_epoch=data.epoch > task.epoch,
        epochs=int((task.spec or {}).get("epochs") or 1),
    )
    task.pace_start_at, task.pace_start_progress = start or (None, None)
    task.pace_epoch_at, task.pace_epoch_progress = mark or (None, None)
    task.progress, task.epoch, task.progress_at = data.progress, data.epoch, now


def _pair(at: datetime | None, progress: float | None) -> tuple[datetime, float] | None:
    return None if at is None or progress is None else (at, progress)


def save_checkpoint(
    session: Session,
    *,
    task: Task,
    directory: Path,
    name: str,
    epoch: int,
    step: int,
    body: bytes,
    attempt: int = 1,
    parts: list[str] | None = None,
) -> Checkpoint:
    """Store an uploaded checkpoint file as `directory/task-<id>/<name>` (`attempt-<n>/` after 1).

    `parts`: the `folder/file` names of its sharded optimizer state (contracts/sharded_state.py),
    which the sharded group's workers upload beside it (:func:`save_checkpoint_part`), in any
    order; a checkpoint is whole once every one is stored (`Checkpoint.missing_parts`).

    A name is stored once and never overwritten: the same name with the same bytes
    again (an upload retried after a lost answer) returns the stored checkpoint.

    A new epoch-end checkpoint of a shrunk task may take it in again on its whole request
    (:func:`backend.scheduler.regrow.at_epoch_end`, after the checkpoint is committed; its
    failure never refuses the upload).

    Raises:
        Invalid: `name` is empty, `.`/`..`, hidden, or not a plain file name (field `name`).
        Conflict: a checkpoint of this name and attempt with other content exists (`name`).
        Invalid: a part that is no state folder's file (field `parts`).
    """
    check_checkpoint_name(name)
    for part in parts or []:
        try:
            sharded_state.check_part(part)
        except ValueError as exc:
            raise Invalid(str(exc), field="parts") from None
    folder = attempt_folder(directory, task, attempt)
    path = (folder / name).resolve()
    if not _write_new(path, body):
        if path.read_bytes() != body:
            raise Conflict(
                f"checkpoint '{name}' of attempt {attempt} already exists with "
                "other content; it is kept",
                field="name",
            )
        stored = session.scalar(
            select(Checkpoint)
            .where(Checkpoint.task_id == task.id, Checkpoint.path == str(path))
            .limit(1)
        )
        if stored is not None:
            return stored
    checkpoint = Checkpoint(
        task_id=task.id,
        epoch=epoch,
        step=step,
        path=str(path),
        size_bytes=len(body),
        attempt=attempt,
        parts=list(parts) if parts else None,
    )
    session.add(checkpoint)
    session.commit()
    try:
        regrow.at_epoch_end(session, task=task, checkpoint=checkpoint)
    except Exception:  # the checkpoint is stored; the task goes on shrunk
        log.exception("task %s: taking it in again at %s failed", task.id, name)
        session.rollback()
    # Loaded again here, in the caller's worker thread: a rollback above expired it, and the
    # answer is built from it on the event loop.
    session.refresh(checkpoint)
    return checkpoint


def attempt_folder(directory: Path, task: Task, attempt: int) -> Path:
    """The folder of a task's checkpoints of `attempt` (`task-<id>/`, `attempt-<n>/` after 1),
    made if missing."""
    folder = directory / f"task-{task.id}"
    if attempt > 1:
        folder = folder / f"attempt-{attempt}"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder


def save_checkpoint_part(
    *, task: Task, directory: Path, part: str, body: bytes, attempt: int = 1
) -> Path:
    """Store a file of a checkpoint's state folder (`part`: `step-8.pt.dcp/__1_0.distcp`),
    uploaded by the worker that wrote it, beside the checkpoints of `attempt`; before or after
    the checkpoint file itself. Stored once: the same bytes again are kept, other bytes refused.

    Raises:
        Invalid: `part` is no state folder's file (field `part`).
        Conflict: the part is stored with other content (`part`).
    """
    try:
        folder_name, name = sharded_state.check_part(part)
    except ValueError as exc:
        raise Invalid(str(exc), field="part") from None
    folder = attempt_folder(directory, task, attempt) / folder_name
    folder.mkdir(exist_ok=True, mode=0o700)
    path = folder / name
    if not _write_new(path, body) and path.read_bytes() != body:
        raise Conflict(
            f"part {part!r} of attempt {attempt} already exists with other content; it is kept",
            field="part",
        )
    return path


def add_alarm(session: Session, *, task: Task, data: Alarm) -> bool:
    """Record the alarm (or guard move, ``data.kind``) as a task event, unless it comes from an
    earlier attempt or the same reason was recorded in this attempt already (a retried
    request). Returns True if stored."""
    if data.attempt != task.attempt:
        return False
    kind = EventKind(data.kind)
    reason = f"{data.kind} in attempt {data.attempt}: {data.reason}"
    done = session.scalar(
        select(TaskEvent.id)
        .where(
            TaskEvent.task_id == task.id,
            TaskEvent.kind == kind,
            TaskEvent.reason == reason,
        )
        .limit(1)
    )
    if done is not None:
        return False
    lifecycle.alarm(session, task, reason, kind)
    session.commit()
    return True


def check_checkpoint_name(name: str) -> None:
    """Refuse a checkpoint name that is not one plain, visible file name.

    Raises:
        Invalid: naming the field `name`.
    """
    if not CHECKPOINT_NAME.fullmatch(name):
        raise Invalid(
            f"checkpoint name {name!r} is not a file name: use letters, digits, '.', "
            "'_' and '-', not starting with '.' (e.g. 'epoch-3.pt')",
            field="name",
        )


def _write_new(path: Path, body: bytes) -> bool:
    """Write `body` to `path` only if no file is there (atomic: a half-written file is never
    seen under `path`); False if one is."""
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".upload-", delete=False) as tmp:
        tmp.write(body)
    try:
        os.link(tmp.name, path)  # fails if `path` exists, unlike a rename
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp.name)
    return True


def node_heartbeats(
    session: Session,
    *,
    running: list[RunningRanks],
    stamps: "HeldStamps | None" = None,
    at: datetime | None = None,
) -> None:
    """Stamp, at `at` (now by default), the held allocations of ranks whose processes an
    agent saw alive (with `stamps`: held there, written with the others within a second),
    and store their resource samples (`record_usage`). The caller commits."""
    now = at or utcnow()
    for entry in running:
        if stamps is not None:
            stamps.ranks(entry.task_id, entry.ranks, now)
        else:
            session.execute(
                update(Allocation)
                .where(
                    Allocation.task_id == entry.task_id,
                    Allocation.rank.in_(entry.ranks),
                    Allocation.released_at.is_(None),
                )
                .values(last_heartbeat_at=now)
            )
        if entry.samples:
            record_usage(session, task_id=entry.task_id, samples=entry.samples)


def record_usage(session: Session, *, task_id: int, samples: list[RankSample]) -> None:
    """Store the resource samples of an active task's held ranks (rank 0: the parameter
    server) as metrics (`RESOURCE_METRICS`, with the rank and the task's current epoch;
    step 0), and raise one alarm per rank and attempt whose memory (RSS) reaches
    `MEMORY_ALARM_FRACTION` of the task's memory limit. Samples of a task not active, or
    of a rank it does not hold, are dropped. The caller commits."""
    task = session.get(Task, task_id, options=[lazyload(Task.tag_rows)])  # not its tags
    if task is None or task.status not in ACTIVE:
        return
    held = {
        (rank or 0) if role is NodeRole.PARAMETER_SERVER else rank
        for role, rank in session.execute(
            select(Allocation.role, Allocation.rank).where(
                Allocation.task_id == task_id,
                Allocation.role.in_([NodeRole.PARAMETER_SERVER, NodeRole.COMPUTE]),
                Allocation.released_at.is_(None),
            )
        )
    }
    limit_mb = (read_spec(task).limits or TaskLimits()).memory_limit_mb
    for sample in (s for s in samples if s.rank in held):
        values = (sample.cpu_percent, sample.rss_mb, sample.gpu_util, sample.gpu_mem_mb)
        session.add_all(
            Metric(
                task_id=task_id, name=name, value=value, rank=sample.rank, epoch=task.epoch, step=0
            )
            for name, value in zip(RESOURCE_METRICS, values, strict=True)
            if value is not None
        )
        if sample.rss_mb >= MEMORY_ALARM_FRACTION * limit_mb:
            _memory_alarm(session, task, rank=sample.rank, rss_mb=sample.rss_mb, limit_mb=limit_mb)


def _memory_alarm(session: Session, task: Task, *, rank: int, rss_mb: float, limit_mb: int) -> None:
    """Alarm that the rank's memory nears its limit, unless already done in this attempt."""
    said = f"alarm: rank {rank} of attempt {task.attempt} is near its memory limit"
    done = session.scalar(
        select(TaskEvent.id)
        .where(
            TaskEvent.task_id == task.id,
            TaskEvent.kind == EventKind.ALARM,
            TaskEvent.reason.startswith(said, autoescape=True),
        )
        .limit(1)
    )
    if done is None:
        lifecycle.alarm(
            session, task, f"{said}: {rss_mb:.0f} MiB resident of memory_limit_mb={limit_mb}"
        )
