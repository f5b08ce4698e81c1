"""agent instance id: a second live agent cannot take a name another one uses

Revision ID: a9c4e2f1b7d3
Revises: 5b1e0c7d2a41
Create Date: 2026-11-25 11:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "a9c4e2f1b7d3"
down_revision: str | None = "5b1e0c7d2a41"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("agent") as batch_op:
        batch_op.add_column(sa.Column("instance_id", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("agent") as batch_op:
        batch_op.drop_column("instance_id")
