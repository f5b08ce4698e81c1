"""a checkpoint's sharded optimizer state: the files of its state folder

Revision ID: a9d2e4f6b8c1
Revises: f8b4d6c0e2a3
Create Date: 2026-11-29 23:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "a9d2e4f6b8c1"
down_revision: str | None = "f8b4d6c0e2a3"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoint") as batch:
        batch.add_column(sa.Column("parts", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoint") as batch:
        batch.drop_column("parts")
