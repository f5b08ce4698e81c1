"""task pace epoch: the first report of the latest epoch the attempt entered, so its pace
spans whole epochs

Revision ID: b2d5f8a1c3e9
Revises: a1c4e7b9d2f6
Create Date: 2026-11-28 04:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "b2d5f8a1c3e9"
down_revision: str | None = "a1c4e7b9d2f6"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("task", sa.Column("pace_epoch_at", sa.DateTime(), nullable=True))
    op.add_column("task", sa.Column("pace_epoch_progress", sa.Float(), nullable=True))


def downgrade() -> None:
    # SQLite's batch mode copies the table and would rebuild the queue's partial index
    # without its DESC: drop it first and create it again as it was.
    op.drop_index("ix_task_queue", table_name="task")
    with op.batch_alter_table("task") as batch_op:
        batch_op.drop_column("pace_epoch_progress")
        batch_op.drop_column("pace_epoch_at")
    queued = sa.text("status = 'QUEUED' AND NOT waiting")
    op.create_index(
        "ix_task_queue",
        "task",
        [sa.text("priority DESC"), "id"],
        postgresql_where=queued,
        sqlite_where=queued,
    )
