"""shard provenance: which compute worker took which samples, per checkpoint

Revision ID: f7a9c1d3e5b8
Revises: e6f3b8d0a4c2
Create Date: 2026-11-26 11:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "f7a9c1d3e5b8"
down_revision: str | None = "e6f3b8d0a4c2"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "shard_record",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("step_from", sa.Integer(), nullable=False),
        sa.Column("step_to", sa.Integer(), nullable=False),
        sa.Column("worker", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("group_index", sa.Integer(), nullable=False),
        sa.Column("group", sa.String(length=100), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("index_hash", sa.String(length=16), nullable=False),
        sa.Column("rebalanced", sa.Integer(), nullable=False),
        sa.Column("exchanged", sa.Integer(), nullable=False),
        sa.Column("n_items", sa.Integer(), nullable=False),
        sa.Column("set_hash", sa.String(length=16), nullable=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoint.id"],
            name=op.f("fk_shard_record_checkpoint_id_checkpoint"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["task_id"], ["task.id"], name=op.f("fk_shard_record_task_id_task"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_shard_record")),
    )
    with op.batch_alter_table("shard_record") as batch_op:
        batch_op.create_index(batch_op.f("ix_shard_record_task_id"), ["task_id"])
        batch_op.create_index(batch_op.f("ix_shard_record_checkpoint_id"), ["checkpoint_id"])


def downgrade() -> None:
    op.drop_table("shard_record")
