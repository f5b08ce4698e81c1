"""sub-task preparing: claimed while its agent builds the code version's environment

Revision ID: c3e6a9b2d4f7
Revises: b2d5f8a1c3e9
Create Date: 2026-11-28 10:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "c3e6a9b2d4f7"
down_revision: str | None = "b2d5f8a1c3e9"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "sub_task",
        sa.Column("preparing", sa.Boolean(), nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    with op.batch_alter_table("sub_task") as batch_op:
        batch_op.drop_column("preparing")
