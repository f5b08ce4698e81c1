"""Tasks, their dependencies, lifecycle events, allocations (nodes), logs, metrics and
checkpoints."""

import enum
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import (
    JSON,
    Enum,
    Float,
    ForeignKey,
    Index,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from backend.core.db import Base, utcnow
from contracts.agent_api import ACTIVE_STATUSES


class TaskStatus(enum.StrEnum):
    QUEUED = "QUEUED"
    SCHEDULED = "SCHEDULED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    RESTARTING = "RESTARTING"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def active(self) -> bool:
        """Placed and holding nodes: its agents run (or are about to run) its current attempt."""
        return self in ACTIVE


TERMINAL = frozenset({TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELLED})
# The one set of active statuses (the lifecycle, the monitor, claims and dispatch use it).
ACTIVE = frozenset(TaskStatus(name) for name in ACTIVE_STATUSES)


class NodeRole(enum.StrEnum):
    TASK_MANAGER = "task_manager"
    PARAMETER_SERVER = "parameter_server"
    COMPUTE = "compute"


class SubTaskStatus(enum.StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    ABORTED = "ABORTED"


class EventKind(enum.StrEnum):
    """A task event is a status change, an alarm (a failure detected by the monitor), a
    guard move (the engine's guard parked a group or took it back, worker/engine/guard.py), or
    a phase before training (an agent builds the code version's environment)."""

    STATUS = "status"
    ALARM = "alarm"
    GUARD = "guard"
    PHASE = "phase"


def _enum(cls: type[enum.Enum]) -> Enum:
    return Enum(cls, native_enum=False, length=16, validate_strings=True)


T = TypeVar("T")


def remaining_s(
    first: tuple[float, float],
    last: tuple[float, float],
    epoch_s: float | None = None,
    epoch_progress: float | None = None,
) -> float:
    """Seconds from the latest progress report to the finish, at the measured pace.

    ``first`` and ``last`` are ``(seconds, progress)`` of the attempt's first report after
    its first step and of the latest one (seconds on one clock, progress in [0, 1]);
    ``epoch_s`` and ``epoch_progress`` those of the first report of the latest epoch
    entered since, if any. The pace is the progress gained over the time it took: from
    ``first`` to that epoch's first report once an epoch has ended, so it spans whole
    epochs with their ends (validation, checkpoint), which come as often in the rest of the
    task; until then from ``first`` to ``last``. Step reports alone would leave out the
    epoch ends still to come (``bench.plan_error`` found its ETA at 25 % progress short
    that way). Extrapolated linearly from ``last`` to progress 1.

    Raises ZeroDivisionError when the span gained no progress (the caller checks).
    """
    (t0, p0), (t1, p1) = first, last
    if epoch_s is not None and epoch_progress is not None and epoch_progress > p0:
        t1, p1 = epoch_s, epoch_progress
    return (t1 - t0) / (p1 - p0) * (1.0 - last[1])


def next_pace(
    start: tuple[T, float] | None,
    mark: tuple[T, float] | None,
    report: tuple[T, float],
    *,
    new_epoch: bool,
    epochs: int,
) -> tuple[tuple[T, float] | None, tuple[T, float] | None]:
    """The pace's ``(start, epoch mark)``, each ``(time, progress)`` or None, after a progress
    ``report`` of the attempt (:func:`remaining_s` reads them; ``new_epoch``: the report is
    the first of an epoch, ``epochs``: the task's). A report with progress > 0 starts the
    pace when there is none, or when it is below the start (a resume from an earlier
    checkpoint). The first report of an epoch marks where the pace's whole epochs end,
    unless the pace started less than 3/4 of an epoch before it (a resume mid-epoch: the
    span would be part of an epoch's steps and a whole end): the pace starts there again."""
    progress = report[1]
    if progress > 0 and (start is None or progress < start[1]):
        return report, None
    if start is not None and new_epoch:
        if mark is None and progress - start[1] < 0.75 / epochs:
            return report, None
        return start, report
    return start, mark


class Task(Base):
    """One distributed training run of one code version.

    `spec` holds the validated training settings (epochs, global batch size,
    split policy, the groups with their workers). `master_addr`/`master_port`
    are the torch.distributed rendezvous published by the agent that hosts
    the parameter server. `attempt` counts runs (1 = first); a restart after
    a failure starts the next one, up to `max_restarts` restarts. `waiting` is
    true while a task of `depends_on` has not succeeded yet.
    """

    __tablename__ = "task"
    # The scheduler's queue: an index scan by priority then age, never the whole table.
    __table_args__ = (
        Index(
            "ix_task_queue",
            text("priority DESC"),
            "id",
            postgresql_where=text("status = 'QUEUED' AND NOT waiting"),
            sqlite_where=text("status = 'QUEUED' AND NOT waiting"),
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(
        ForeignKey("project.id", ondelete="CASCADE"), index=True
    )
    code_version_id: Mapped[int] = mapped_column(ForeignKey("code_version.id"))
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[TaskStatus] = mapped_column(
        _enum(TaskStatus), default=TaskStatus.QUEUED, index=True
    )
    status_reason: Mapped[str] = mapped_column(Text, default="")
    priority: Mapped[int] = mapped_column(default=0)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    epoch: Mapped[int] = mapped_column(default=0)
    master_addr: Mapped[str | None] = mapped_column(String(200), default=None)
    master_port: Mapped[int | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    attempt: Mapped[int] = mapped_column(default=1, server_default="1")
    max_restarts: Mapped[int] = mapped_column(default=2, server_default="2")
    waiting: Mapped[bool] = mapped_column(default=False, server_default=text("false"))
    # The current attempt's first progress report after its first step (when, at what
    # progress) and the latest report's time: the measured pace behind `eta_s`.
    pace_start_at: Mapped[datetime | None] = mapped_column(default=None)
    pace_start_progress: Mapped[float | None] = mapped_column(Float, default=None)
    progress_at: Mapped[datetime | None] = mapped_column(default=None)
    # The first report of the latest epoch the attempt entered after its pace started (when,
    # at what progress): the pace then spans whole epochs, their ends included.
    pace_epoch_at: Mapped[datetime | None] = mapped_column(default=None)
    pace_epoch_progress: Mapped[float | None] = mapped_column(Float, default=None)
    # The hyperparameter sweep the task is a trial of (backend/sweeps), if any.
    sweep_id: Mapped[int | None] = mapped_column(
        ForeignKey("sweep.id", ondelete="SET NULL"), index=True, default=None
    )
    # Free-form labels (`TaskTag`), loaded with the task: lists filter by them.
    tag_rows: Mapped[list["TaskTag"]] = relationship(
        lazy="selectin", cascade="all, delete-orphan", passive_deletes=True, order_by="TaskTag.name"
    )

    @property
    def tags(self) -> list[str]:
        """The task's tags, sorted."""
        return [row.name for row in self.tag_rows]

    def set_tags(self, names: list[str]) -> None:
        """Replace the task's tags with `names` (already validated, `contracts.task_spec`)."""
        keep, have = set(names), {row.name: row for row in self.tag_rows}
        self.tag_rows = [have.get(name) or TaskTag(name=name) for name in sorted(keep)]

    def finish_estimate(self, now: datetime) -> tuple[float | None, datetime | None]:
        """Seconds to finish and the predicted finish (naive UTC) at ``now``, from the pace of
        this attempt's measured steps (:func:`remaining_s`): progress gained since its first
        report over the time it took, over whole epochs once one has ended, extrapolated
        from the latest report. (0, finished_at) once succeeded;
        (None, None) when it failed or was cancelled, before two reports with progress
        between them (startup, profiling and validation before the first step are not
        counted in the pace), and once the predicted finish has passed with the task still
        running (its reports stopped or slowed: no estimate rather than "0 s left").

        Before that pace exists, a task submitted from a plan (`spec.predicted_s`, its plan's
        performance model, `backend/plans/performance.py`) is estimated from the prediction:
        the predicted seconds from its start (from now while it has not started).
        """
        if self.status is TaskStatus.SUCCEEDED:
            return 0.0, self.finished_at
        if self.status.terminal:
            return None, None
        start, since, last = self.pace_start_at, self.pace_start_progress, self.progress_at
        if start is None or since is None or last is None or self.progress <= since:
            return self._predicted(now)
        if self.status is not TaskStatus.RUNNING or last <= start:
            return self._predicted(now)
        epoch_at = self.pace_epoch_at
        remaining = remaining_s(
            (0.0, since),
            ((last - start).total_seconds(), self.progress),
            None if epoch_at is None else (epoch_at - start).total_seconds(),
            self.pace_epoch_progress,
        )
        try:
            finish = last + timedelta(seconds=remaining)
        except OverflowError:  # a vanishing gain of progress: no estimate
            return None, None
        if finish < now:
            return None, None
        return (finish - now).total_seconds(), finish

    def _predicted(self, now: datetime) -> tuple[float | None, datetime | None]:
        """The plan's prediction (`spec.predicted_s` seconds from the start), or (None, None)."""
        predicted = (self.spec or {}).get("predicted_s")
        if predicted is None:
            return None, None
        begun = self.started_at if self.started_at is not None else now
        finish = begun + timedelta(seconds=float(predicted))
        if finish < now:
            return None, None
        return (finish - now).total_seconds(), finish

    @property
    def eta_s(self) -> float | None:
        """Seconds to finish now (:meth:`finish_estimate`)."""
        return self.finish_estimate(utcnow())[0]

    @property
    def predicted_finish_at(self) -> datetime | None:
        """The predicted finish, naive UTC (:meth:`finish_estimate`)."""
        return self.finish_estimate(utcnow())[1]


class TaskTag(Base):
    """A label on a task (`baseline`, `lr-sweep`, `paper:fig3`): a user's own grouping of
    runs, filtered on in task lists (`GET /tasks?tag=`) and shown in comparisons."""

    __tablename__ = "task_tag"

    task_id: Mapped[int] = mapped_column(
        ForeignKey("task.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(64), primary_key=True, index=True)


class TaskDependency(Base):
    """`task_id` waits for `depends_on_id` to succeed (and fails if it does not)."""

    __tablename__ = "task_dependency"

    task_id: Mapped[int] = mapped_column(
        ForeignKey("task.id", ondelete="CASCADE"), primary_key=True
    )
    depends_on_id: Mapped[int] = mapped_column(
        ForeignKey("task.id", ondelete="CASCADE"), primary_key=True, index=True
    )


class TaskEvent(Base):
    """A recorded lifecycle transition (or alarm) of a task."""

    __tablename__ = "task_event"

    id: Mapped[int] = mapped_column(primary_key=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("task.id", ondelete="CASCADE"), index=True)
    from_status: Mapped[TaskStatus | None] = mapped_column(_enum(TaskStatus), default=None)
    to_status: Mapped[TaskStatus] = mapped_column(_enum(TaskStatus))
    reason: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    kind: Mapped[EventKind] = mapped_column(
        _enum(EventKind), default=EventKind.STATUS, server_default="STATUS"
    )


class SubTask(Base):
    """A task's part of one resource group on one agent, in one attempt.

    A group's workers are booked across its serving agents (docs/architecture.md,
    "The scheduler and a task's fate"): part `part` (0, 1, ... within the group) holds
    compute ranks `first_rank` .. `first_rank + workers - 1` and is booked for agent
    `agent_id`, the only agent that may claim it; a part whose agent cannot take it
    (drained, offline, or short of free workers) is unbound (`agent_id` null) and booked
    for another agent of the group at the scheduler's next pass. First-level dispatch
    sends one Celery message per sub-task, to its agent's queue, whose Celery id is the
    sub-task's id. `dispatched_at` is null until the message is published (it is published
    again if lost)."""

    __tablename__ = "sub_task"
    __table_args__ = (UniqueConstraint("task_id", "attempt", "group_index", "part"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("task.id", ondelete="CASCADE"), index=True)
    resource_group_id: Mapped[int] = mapped_column(ForeignKey("resource_group.id"))
    group_index: Mapped[int]
    part: Mapped[int] = mapped_column(default=0, server_default="0")
    first_rank: Mapped[int]
    workers: Mapped[int]
    hosts_parameter_server: Mapped[bool] = mapped_column(default=False)
    status: Mapped[SubTaskStatus] = mapped_column(
        _enum(SubTaskStatus), default=SubTaskStatus.PENDING
    )
    agent_id: Mapped[int | None] = mapped_column(ForeignKey("agent.id", ondelete="SET NULL"))
    detail: Mapped[str] = mapped_column(Text, default="")
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    attempt: Mapped[int] = mapped_column(default=1, server_default="1")
    dispatched_at: Mapped[datetime | None] = mapped_column(default=None)
    # The agent's token for the claim that took it (Claim.claim_id): its retry is answered again.
    claim_id: Mapped[str | None] = mapped_column(String(64), default=None)
    # Claimed, but its agent builds the code version's environment first (Claim.preparing):
    # the task does not count as started while a part of its attempt prepares.
    preparing: Mapped[bool] = mapped_column(default=False, server_default=false())


class Allocation(Base):
    """A node of a running task: task manager, parameter server or compute worker.

    Held while `released_at` is null; every terminal transition releases all.
    """

    __tablename__ = "allocation"
    # Capacity accounting counts held nodes only, however long the history grows.
    __table_args__ = (
        Index(
            "ix_allocation_held",
            "resource_group_id",
            postgresql_where=text("released_at IS NULL"),
            sqlite_where=text("released_at IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("task.id", ondelete="CASCADE"), index=True)
    role: Mapped[NodeRole] = mapped_column(_enum(NodeRole))
    resource_group_id: Mapped[int] = mapped_column(ForeignKey("resource_group.id"), index=True)
    rank: Mapped[int | None] = mapped_column(default=None)
    host: Mapped[str | None] = mapped_column(String(200), default=None)
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    released_at: Mapped[datetime | None] = mapped_column(default=None, index=True)
    attempt: Mapped[int] = mapped_column(default=1, server_default="1")


class LogLine(Base):
    """One line of a node's output. `id` is the stream cursor; `seq` counts per node and
    attempt from 0, without gaps (a restarted task's nodes start a new sequence)."""

    __tablename__ = "log_line"
    __table_args__ = (UniqueConstraint("task_id", "attempt", "node", "seq"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("task.id", ondelete="CASCADE"), index=True)
    node: Mapped[str] = mapped_column(String(64))
    seq: Mapped[int]
    time: Mapped[datetime] = mapped_column(default=utcnow)
    text: Mapped[str] = mapped_column(Text)
    attempt: Mapped[int] = mapped_column(default=1, server_default="1")


class Metric(Base):
    """A scalar reported by a task: per epoch (loss, accuracy) or per worker (samples/s).

    A value that is not finite has ``value`` None and ``nonfinite`` "nan", "inf" or
    "-inf" (JSON and SQLite cannot hold NaN), so it is shown rather than dropped.
    ``attempt``, ``node`` and ``seq`` number a reporter's values (`contracts.agent_api.
    MetricIn`): one is stored once however often its report is sent; unnumbered ones (an
    older agent, a resource sample) are NULL there and never conflict.
    """

    __tablename__ = "metric"
    __table_args__ = (
        # Partial: only numbered values are indexed (resource samples, an older agent's
        # values are not), so the index starts empty on an existing table.
        Index(
            "uq_metric_seq",
            "task_id",
            "attempt",
            "node",
            "seq",
            unique=True,
            postgresql_where=text("seq IS NOT NULL"),
            sqlite_where=text("seq IS NOT NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("task.id", ondelete="CASCADE"), index=True)
    step: Mapped[int]
    epoch: Mapped[int]
    name: Mapped[str] = mapped_column(String(100))
    value: Mapped[float | None] = mapped_column(Float)
    nonfinite: Mapped[str | None] = mapped_column(String(8), default=None)
    rank: Mapped[int | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    attempt: Mapped[int | None] = mapped_column(default=None)
    node: Mapped[str | None] = mapped_column(String(64), default=None)
    seq: Mapped[int | None] = mapped_column(default=None)


STEP_SERIES = "step/"
"""The name prefix of a per-step series (``step/train_loss``, ``step/samples_per_s``,
``step/lr``, a training code's ``step/train_<name>``: ``worker.engine.report.STEP_SERIES``);
every other metric is per epoch (or an agent's resource sample). The metric table holds
both; ``GET /tasks/{id}/metrics?scale=step|epoch`` tells them apart by it."""

RESOURCE_METRICS = ("rank_cpu_percent", "rank_rss_mb", "rank_gpu_util", "rank_gpu_mem_mb")
"""The metrics an agent measures of each rank (its heartbeats' samples), not the training code:
CPU percent of one core, resident memory (MiB), GPU utilization (percent) and memory (MiB)."""


class Checkpoint(Base):
    __tablename__ = "checkpoint"

    id: Mapped[int] = mapped_column(primary_key=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("task.id", ondelete="CASCADE"), index=True)
    epoch: Mapped[int]
    step: Mapped[int]
    path: Mapped[str] = mapped_column(String(500))
    size_bytes: Mapped[int]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    attempt: Mapped[int] = mapped_column(default=1, server_default="1")
    # The ``folder/file`` names of its sharded optimizer state (contracts/sharded_state.py),
    # uploaded by the sharded group's workers beside it; None: the file holds it all.
    parts: Mapped[list[str] | None] = mapped_column(JSON, nullable=True, default=None)

    @property
    def sharded_files(self) -> int:
        """How many files its workers' optimizer states have beside it (0: the file holds
        them all)."""
        return len(self.parts or [])

    @property
    def state_bytes(self) -> int:
        """Bytes of those files stored so far."""
        base = Path(self.path).parent
        return sum((base / p).stat().st_size for p in self.parts or [] if (base / p).is_file())

    @property
    def complete(self) -> bool:
        """Whether every file of it is stored: only then is it resumed from or downloaded."""
        return not self.missing_parts()

    def missing_parts(self) -> list[str]:
        """The parts of its sharded state not stored yet (none for a whole file): a
        checkpoint missing one can be neither resumed from nor downloaded."""
        base = Path(self.path).parent
        return [p for p in self.parts or [] if not (base / p).is_file()]


class ShardRecord(Base):
    """The samples one compute worker took between two checkpoints of one epoch of one
    attempt (``worker.engine.provenance``): `samples` of them, `index_hash` the additive
    multiset hash of their indices (16 hex digits; hashes of disjoint sets add mod 2**64),
    `rebalanced`/`exchanged` how many a rebalance or the neighbour exchange moved to it.
    `n_items` and `set_hash` are the training set's size and whole-set hash, to check an
    epoch's records against. Stored with the checkpoint whose state holds their updates."""

    __tablename__ = "shard_record"

    id: Mapped[int] = mapped_column(primary_key=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("task.id", ondelete="CASCADE"), index=True)
    checkpoint_id: Mapped[int] = mapped_column(
        ForeignKey("checkpoint.id", ondelete="CASCADE"), index=True
    )
    attempt: Mapped[int]
    epoch: Mapped[int]
    step_from: Mapped[int]
    step_to: Mapped[int]
    worker: Mapped[int]
    rank: Mapped[int]
    group_index: Mapped[int]
    group: Mapped[str] = mapped_column(String(100))
    samples: Mapped[int]
    index_hash: Mapped[str] = mapped_column(String(16))
    rebalanced: Mapped[int]
    exchanged: Mapped[int]
    n_items: Mapped[int]
    set_hash: Mapped[str] = mapped_column(String(16))
