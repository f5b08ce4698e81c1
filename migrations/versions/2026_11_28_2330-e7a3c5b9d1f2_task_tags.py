"""task tags: free-form labels on a task, for filtering and comparing runs

Revision ID: e7a3c5b9d1f2
Revises: 0f5cf8161d69
Create Date: 2026-11-28 23:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "e7a3c5b9d1f2"
down_revision: str | None = "0f5cf8161d69"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "task_tag",
        sa.Column("task_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["task_id"], ["task.id"], name=op.f("fk_task_tag_task_id_task"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("task_id", "name", name=op.f("pk_task_tag")),
    )
    op.create_index(op.f("ix_task_tag_name"), "task_tag", ["name"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_task_tag_name"), table_name="task_tag")
    op.drop_table("task_tag")
