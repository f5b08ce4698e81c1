"""metric nonfinite: a NaN or infinite metric value is stored, not dropped

Revision ID: 9879ba3bbc45
Revises: a7c3e5f9b2d4
Create Date: 2026-11-25 11:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "9879ba3bbc45"
down_revision: str | None = "a7c3e5f9b2d4"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("metric") as batch_op:
        batch_op.alter_column("value", existing_type=sa.Float(), nullable=True)
        batch_op.add_column(sa.Column("nonfinite", sa.String(length=8), nullable=True))


def downgrade() -> None:
    op.execute("DELETE FROM metric WHERE value IS NULL")
    with op.batch_alter_table("metric") as batch_op:
        batch_op.drop_column("nonfinite")
        batch_op.alter_column("value", existing_type=sa.Float(), nullable=False)
