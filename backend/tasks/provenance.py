"""Shard provenance: store what the parameter server recorded with each checkpoint, and read
it back per epoch with the check that the epoch's records cover the training set once.

The engine's records (``worker.engine.provenance``) name a worker by group and rank; the host
comes from the task's allocations (the compute node of that rank in that attempt). An epoch's
records are those of every attempt whose checkpoints hold them: a failed attempt's work after
its last checkpoint was discarded and is recorded by the attempt that redid it. A later
attempt may also resume from an earlier checkpoint than the failed one's last (one uploaded
after the restart was decided): its first record starts at the step it resumed from, and
the earlier attempts' records after that step are *discarded* (shown, not counted: the
model does not hold their updates). The epoch covers the training set *exactly once* when
its kept records' sample counts sum to ``n_items`` and their hashes (additive multiset
hashes) sum, mod 2**64, to the whole set's hash.
"""

from collections import defaultdict

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from backend.tasks.models import Allocation, Checkpoint, NodeRole, ShardRecord, Task
from backend.tasks.schemas import EpochProvenance, ProvenanceRead, ShardRecordRead
from contracts.agent_api import Provenance

_MOD = 2**64


def store(session: Session, *, task: Task, checkpoint: Checkpoint, data: Provenance) -> int:
    """Keep the records a checkpoint carried (replacing any sent for it before: an agent's
    retry after a lost answer stores them once). Returns how many were stored."""
    session.execute(delete(ShardRecord).where(ShardRecord.checkpoint_id == checkpoint.id))
    session.add_all(
        ShardRecord(
            task_id=task.id,
            checkpoint_id=checkpoint.id,
            attempt=checkpoint.attempt,
            n_items=data.n_items,
            set_hash=data.set_hash,
            **record.model_dump(),
        )
        for record in data.records
    )
    session.commit()
    return len(data.records)


def read(session: Session, *, task: Task, last_epochs: int | None = None) -> ProvenanceRead:
    """Every epoch's records in step and worker order, with hosts and the coverage check;
    only the latest `last_epochs` epochs when given (the others counted in
    `earlier_epochs`), read without loading the earlier ones."""
    mine = ShardRecord.task_id == task.id
    query = select(ShardRecord).where(mine)
    earlier = 0
    if last_epochs is not None:
        recorded = select(ShardRecord.epoch).where(mine).distinct()
        first = session.scalar(
            recorded.order_by(ShardRecord.epoch.desc()).offset(last_epochs - 1).limit(1)
        )
        if first is not None:
            query = query.where(ShardRecord.epoch >= first)
            earlier = (
                session.scalar(
                    select(func.count()).select_from(
                        recorded.where(ShardRecord.epoch < first).subquery()
                    )
                )
                or 0
            )
    rows = session.scalars(
        query.order_by(
            ShardRecord.epoch, ShardRecord.step_from, ShardRecord.attempt, ShardRecord.worker
        )
    ).all()
    hosts = {
        (a.attempt, a.rank): a.host
        for a in session.scalars(
            select(Allocation).where(
                Allocation.task_id == task.id, Allocation.role == NodeRole.COMPUTE
            )
        )
    }
    # attempt -> the step its first record starts from (over every epoch, listed or not)
    resumed_at: dict[int, int] = {
        attempt: step
        for attempt, step in session.execute(
            select(ShardRecord.attempt, func.min(ShardRecord.step_from))
            .where(mine)
            .group_by(ShardRecord.attempt)
        )
    }
    by_epoch: dict[int, list[ShardRecord]] = defaultdict(list)
    for row in rows:
        by_epoch[row.epoch].append(row)
    epochs = []
    last = max(by_epoch, default=None)
    for epoch, records in sorted(by_epoch.items()):
        n_items, set_hash = records[-1].n_items, records[-1].set_hash
        kept = {r.id: _kept(r, resumed_at) for r in records}
        counted = [r for r in records if kept[r.id]]
        samples = sum(r.samples for r in counted)
        total = sum(int(r.index_hash, 16) for r in counted) % _MOD
        epochs.append(
            EpochProvenance(
                epoch=epoch,
                n_items=n_items,
                samples=samples,
                index_hash=f"{total:016x}",
                set_hash=set_hash,
                exactly_once=(once := samples == n_items and total == int(set_hash, 16)),
                in_progress=not once and epoch == last and not task.status.terminal,
                attempts=sorted({r.attempt for r in counted}),
                records=[
                    ShardRecordRead.model_validate(
                        {**_columns(r), "host": hosts.get((r.attempt, r.rank)), "kept": kept[r.id]}
                    )
                    for r in records
                ],
            )
        )
    return ProvenanceRead(task_id=task.id, epochs=epochs, earlier_epochs=earlier)


def _kept(row: ShardRecord, resumed_at: dict[int, int]) -> bool:
    """False when a later attempt resumed from a step before this record's end."""
    later = [step for attempt, step in resumed_at.items() if attempt > row.attempt]
    return not later or row.step_to <= min(later)


def _columns(row: ShardRecord) -> dict:
    return {c.key: getattr(row, c.key) for c in ShardRecord.__table__.columns}
