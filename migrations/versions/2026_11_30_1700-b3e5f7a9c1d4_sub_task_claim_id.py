"""a sub-task's claim id: a claim retried after its answer was lost is answered again

Revision ID: b3e5f7a9c1d4
Revises: a9d2e4f6b8c1
Create Date: 2026-11-30 17:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "b3e5f7a9c1d4"
down_revision: str | None = "a9d2e4f6b8c1"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sub_task") as batch:
        batch.add_column(sa.Column("claim_id", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sub_task") as batch:
        batch.drop_column("claim_id")
