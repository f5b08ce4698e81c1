"""agent state and description: admins drain, disable and annotate agents

Revision ID: 5b1e0c7d2a41
Revises: 198561f76852
Create Date: 2026-11-23 09:05:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "5b1e0c7d2a41"
down_revision: str | None = "198561f76852"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("agent") as batch_op:
        batch_op.add_column(
            sa.Column(
                "state",
                sa.Enum(
                    "ACTIVE",
                    "DRAINING",
                    "DISABLED",
                    name="agentstate",
                    native_enum=False,
                    length=16,
                ),
                server_default="ACTIVE",
                nullable=False,
            )
        )
        batch_op.add_column(sa.Column("description", sa.Text(), server_default="", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("agent") as batch_op:
        batch_op.drop_column("description")
        batch_op.drop_column("state")
