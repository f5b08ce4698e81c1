"""hyperparameter sweeps: the sweep table and each task's sweep

Revision ID: f8b4d6c0e2a3
Revises: e7a3c5b9d1f2
Create Date: 2026-11-29 01:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "f8b4d6c0e2a3"
down_revision: str | None = "e7a3c5b9d1f2"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sweep",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("code_version_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("algorithm", sa.String(length=16), nullable=False),
        sa.Column("space", sa.JSON(), nullable=False),
        sa.Column("base", sa.JSON(), nullable=False),
        sa.Column("trials", sa.JSON(), nullable=False),
        sa.Column("submitted", sa.Integer(), nullable=False),
        sa.Column("parallel", sa.Integer(), nullable=False),
        sa.Column("metric", sa.String(length=100), nullable=False),
        sa.Column("goal", sa.String(length=8), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("stopping", sa.JSON(), nullable=False),
        sa.Column("plan_id", sa.Integer(), nullable=True),
        sa.Column("created_by_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["code_version_id"],
            ["code_version.id"],
            name=op.f("fk_sweep_code_version_id_code_version"),
        ),
        sa.ForeignKeyConstraint(
            ["created_by_id"],
            ["user.id"],
            name=op.f("fk_sweep_created_by_id_user"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["project.id"],
            name=op.f("fk_sweep_project_id_project"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweep")),
    )
    op.create_index(op.f("ix_sweep_project_id"), "sweep", ["project_id"], unique=False)
    op.create_index(op.f("ix_sweep_status"), "sweep", ["status"], unique=False)
    with op.batch_alter_table("task", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sweep_id", sa.Integer(), nullable=True))
        batch_op.create_index(batch_op.f("ix_task_sweep_id"), ["sweep_id"], unique=False)
        batch_op.create_foreign_key(
            batch_op.f("fk_task_sweep_id_sweep"), "sweep", ["sweep_id"], ["id"], ondelete="SET NULL"
        )


def downgrade() -> None:
    with op.batch_alter_table("task", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_task_sweep_id_sweep"), type_="foreignkey")
        batch_op.drop_index(batch_op.f("ix_task_sweep_id"))
        batch_op.drop_column("sweep_id")
    op.drop_index(op.f("ix_sweep_status"), table_name="sweep")
    op.drop_index(op.f("ix_sweep_project_id"), table_name="sweep")
    op.drop_table("sweep")
