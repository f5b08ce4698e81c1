"""code version uploader: the user who added a code version (none for older versions)

Revision ID: 0f5cf8161d69
Revises: d4a7c1e9f3b2
Create Date: 2026-11-28 20:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0f5cf8161d69"
down_revision: str | None = "d4a7c1e9f3b2"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("code_version", schema=None) as batch_op:
        batch_op.add_column(sa.Column("uploaded_by_id", sa.Integer(), nullable=True))
        batch_op.create_index(
            batch_op.f("ix_code_version_uploaded_by_id"), ["uploaded_by_id"], unique=False
        )
        batch_op.create_foreign_key(
            batch_op.f("fk_code_version_uploaded_by_id_user"),
            "user",
            ["uploaded_by_id"],
            ["id"],
            ondelete="SET NULL",
        )


def downgrade() -> None:
    with op.batch_alter_table("code_version", schema=None) as batch_op:
        batch_op.drop_constraint(
            batch_op.f("fk_code_version_uploaded_by_id_user"), type_="foreignkey"
        )
        batch_op.drop_index(batch_op.f("ix_code_version_uploaded_by_id"))
        batch_op.drop_column("uploaded_by_id")
