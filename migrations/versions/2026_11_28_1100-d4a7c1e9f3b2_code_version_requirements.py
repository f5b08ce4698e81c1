"""code version requirements: the packages a code version declares, and the lock the portal
resolved them to at upload (exact pins with hashes) with its hash

Revision ID: d4a7c1e9f3b2
Revises: c3e6a9b2d4f7
Create Date: 2026-11-28 11:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "d4a7c1e9f3b2"
down_revision: str | None = "c3e6a9b2d4f7"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("code_version", sa.Column("requirements", sa.Text(), nullable=True))
    op.add_column("code_version", sa.Column("lock", sa.Text(), nullable=True))
    op.add_column("code_version", sa.Column("lock_hash", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("code_version") as batch_op:
        batch_op.drop_column("lock_hash")
        batch_op.drop_column("lock")
        batch_op.drop_column("requirements")
