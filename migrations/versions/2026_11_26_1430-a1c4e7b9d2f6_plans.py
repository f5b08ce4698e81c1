"""plans: a plan's request, trial task, trial timings and fitted performance model

Revision ID: a1c4e7b9d2f6
Revises: f7a9c1d3e5b8
Create Date: 2026-11-26 14:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "a1c4e7b9d2f6"
down_revision: str | None = "f7a9c1d3e5b8"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "plan",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("trial_task_id", sa.Integer(), nullable=True),
        sa.Column("trial", sa.JSON(), nullable=True),
        sa.Column("model", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["project.id"],
            name=op.f("fk_plan_project_id_project"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["trial_task_id"],
            ["task.id"],
            name=op.f("fk_plan_trial_task_id_task"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_plan")),
    )
    with op.batch_alter_table("plan") as batch_op:
        batch_op.create_index(batch_op.f("ix_plan_project_id"), ["project_id"])
        batch_op.create_index(batch_op.f("ix_plan_trial_task_id"), ["trial_task_id"])


def downgrade() -> None:
    op.drop_table("plan")
