"""group accepted models: a resource group's device models (homogeneous groups)

Revision ID: c4f1d2a8e6b7
Revises: 9879ba3bbc45
Create Date: 2026-11-25 18:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "c4f1d2a8e6b7"
down_revision: str | None = "9879ba3bbc45"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Existing groups accept any model until their next agent registers (empty: adopt it).
    op.add_column("resource_group", sa.Column("accepted_models", sa.JSON(), nullable=True))
    op.execute("UPDATE resource_group SET accepted_models = '[]'")
    with op.batch_alter_table("resource_group") as batch_op:
        batch_op.alter_column("accepted_models", existing_type=sa.JSON(), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("resource_group") as batch_op:
        batch_op.drop_column("accepted_models")
