"""sub-task parts: a resource group's workers booked across its agents

Revision ID: d5e2a7c9f3b1
Revises: c4f1d2a8e6b7
Create Date: 2026-11-25 19:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "d5e2a7c9f3b1"
down_revision: str | None = "c4f1d2a8e6b7"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# An existing sub-task is its group's only part: its ranks follow the earlier groups'.
_FIRST_RANK = """
UPDATE sub_task SET first_rank = 1 + COALESCE((
    SELECT SUM(earlier.workers) FROM sub_task AS earlier
    WHERE earlier.task_id = sub_task.task_id AND earlier.attempt = sub_task.attempt
      AND earlier.group_index < sub_task.group_index), 0)
"""


def upgrade() -> None:
    with op.batch_alter_table("sub_task") as batch_op:
        batch_op.add_column(sa.Column("part", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("first_rank", sa.Integer(), nullable=True))
    op.execute(_FIRST_RANK)
    # A pending sub-task was claimable by any agent of its group: unbound, the scheduler
    # books it for an agent with free workers at its next pass.
    op.execute("UPDATE sub_task SET agent_id = NULL, dispatched_at = NULL WHERE status = 'PENDING'")
    with op.batch_alter_table("sub_task") as batch_op:
        batch_op.alter_column("first_rank", existing_type=sa.Integer(), nullable=False)
        batch_op.drop_constraint("uq_sub_task_task_id", type_="unique")
        batch_op.create_unique_constraint(
            "uq_sub_task_task_id", ["task_id", "attempt", "group_index", "part"]
        )


def downgrade() -> None:
    op.execute("DELETE FROM sub_task WHERE part > 0")
    with op.batch_alter_table("sub_task") as batch_op:
        batch_op.drop_constraint("uq_sub_task_task_id", type_="unique")
        batch_op.create_unique_constraint(
            "uq_sub_task_task_id", ["task_id", "attempt", "group_index"]
        )
        batch_op.drop_column("first_rank")
        batch_op.drop_column("part")
