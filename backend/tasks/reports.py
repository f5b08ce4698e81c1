"""What agents report besides a task's fate: log lines, metrics, progress, checkpoints and
the ranks they saw alive."""

import os
import tempfile
from pathlib import Path

from sqlalchemy import select, tuple_, update
from sqlalchemy.orm import Session

from backend.core.db import utcnow
from backend.core.errors import Conflict, Invalid
from backend.tasks.models import Allocation, Checkpoint, LogLine, Metric, Task
from contracts.agent_api import CHECKPOINT_NAME, LogBatch, MetricBatch, Progress, RunningRanks


def add_logs(session: Session, *, task_id: int, batch: LogBatch) -> int:
    """Store log lines; a line already stored (same node and seq) is skipped."""
    keys = {(line.attempt, line.node, line.seq) for line in batch.lines}
    if not keys:
        return 0
    existing = set(
        session.execute(
            select(LogLine.attempt, LogLine.node, LogLine.seq).where(
                LogLine.task_id == task_id,
                tuple_(LogLine.attempt, LogLine.node, LogLine.seq).in_(list(keys)),
            )
        ).all()
    )
    new = [
        LogLine(task_id=task_id, **line.model_dump())
        for line in batch.lines
        if (line.attempt, line.node, line.seq) not in existing
    ]
    session.add_all(new)
    session.commit()
    return len(new)


def add_metrics(session: Session, *, task_id: int, batch: MetricBatch) -> None:
    session.add_all(Metric(task_id=task_id, **m.model_dump()) for m in batch.metrics)
    session.commit()


def set_progress(session: Session, *, task: Task, data: Progress) -> None:
    task.progress, task.epoch = data.progress, data.epoch
    session.commit()


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
) -> Checkpoint:
    """Store an uploaded checkpoint file as `directory/task-<id>/<name>` (`attempt-<n>/` after 1).

    A name is stored once and never overwritten: the same name with the same bytes
    again (an upload retried after a lost answer) returns the stored checkpoint.

    Raises:
        Invalid: `name` is empty, `.`/`..`, hidden, or not a plain file name (field `name`).
        Conflict: a checkpoint of this name and attempt with other content exists (`name`).
    """
    check_checkpoint_name(name)
    folder = directory / f"task-{task.id}"
    if attempt > 1:
        folder = folder / f"attempt-{attempt}"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
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
    )
    session.add(checkpoint)
    session.commit()
    return checkpoint


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


def node_heartbeats(session: Session, *, running: list[RunningRanks]) -> None:
    """Stamp the held allocations of ranks whose processes an agent saw alive."""
    now = utcnow()
    for entry in running:
        session.execute(
            update(Allocation)
            .where(
                Allocation.task_id == entry.task_id,
                Allocation.rank.in_(entry.ranks),
                Allocation.released_at.is_(None),
            )
            .values(last_heartbeat_at=now)
        )
