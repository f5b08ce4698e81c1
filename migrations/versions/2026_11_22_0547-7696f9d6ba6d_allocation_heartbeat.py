"""allocation heartbeat

Revision ID: 7696f9d6ba6d
Revises: e999bfef3daf
Create Date: 2026-11-22 05:47:24.045922
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "7696f9d6ba6d"
down_revision: str | None = "e999bfef3daf"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.add_column(sa.Column("last_heartbeat_at", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.drop_column("last_heartbeat_at")
