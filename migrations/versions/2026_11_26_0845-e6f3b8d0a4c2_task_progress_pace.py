"""task progress pace: where the current attempt's measured progress started and last was

Revision ID: e6f3b8d0a4c2
Revises: d5e2a7c9f3b1
Create Date: 2026-11-26 08:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "e6f3b8d0a4c2"
down_revision: str | None = "d5e2a7c9f3b1"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("task", sa.Column("pace_start_at", sa.DateTime(), nullable=True))
    op.add_column("task", sa.Column("pace_start_progress", sa.Float(), nullable=True))
    op.add_column("task", sa.Column("progress_at", sa.DateTime(), nullable=True))


def downgrade() -> None:
    # SQLite's batch mode copies the table and would rebuild the queue's partial index
    # without its DESC: drop it first and create it again as it was.
    op.drop_index("ix_task_queue", table_name="task")
    with op.batch_alter_table("task") as batch_op:
        batch_op.drop_column("progress_at")
        batch_op.drop_column("pace_start_progress")
        batch_op.drop_column("pace_start_at")
    queued = sa.text("status = 'QUEUED' AND NOT waiting")
    op.create_index(
        "ix_task_queue",
        "task",
        [sa.text("priority DESC"), "id"],
        postgresql_where=queued,
        sqlite_where=queued,
    )
