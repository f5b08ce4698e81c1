"""scheduling and fault tolerance: attempts, dependencies, group states and labels

Revision ID: 198561f76852
Revises: e73cb46ec9a3
Create Date: 2026-11-22 06:10:55.968186
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "198561f76852"
down_revision: str | None = "e73cb46ec9a3"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

QUEUED = sa.text("status = 'QUEUED' AND NOT waiting")
LIVE = sa.text("deleted_at IS NULL")
HELD = sa.text("released_at IS NULL")


def _attempt() -> sa.Column:
    return sa.Column("attempt", sa.Integer(), server_default="1", nullable=False)


def upgrade() -> None:
    op.create_table(
        "task_dependency",
        sa.Column("task_id", sa.Integer(), nullable=False),
        sa.Column("depends_on_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["depends_on_id"],
            ["task.id"],
            ondelete="CASCADE",
            name=op.f("fk_task_dependency_depends_on_id_task"),
        ),
        sa.ForeignKeyConstraint(
            ["task_id"],
            ["task.id"],
            ondelete="CASCADE",
            name=op.f("fk_task_dependency_task_id_task"),
        ),
        sa.PrimaryKeyConstraint("task_id", "depends_on_id", name=op.f("pk_task_dependency")),
    )
    op.create_index(
        op.f("ix_task_dependency_depends_on_id"), "task_dependency", ["depends_on_id"], unique=False
    )
    for table in ("allocation", "checkpoint"):
        with op.batch_alter_table(table) as batch_op:
            batch_op.add_column(_attempt())
    op.create_index(
        "ix_allocation_held",
        "allocation",
        ["resource_group_id"],
        postgresql_where=HELD,
        sqlite_where=HELD,
    )
    with op.batch_alter_table("log_line") as batch_op:
        batch_op.add_column(_attempt())
        batch_op.drop_constraint("uq_log_line_task_id", type_="unique")
        batch_op.create_unique_constraint(
            "uq_log_line_task_id", ["task_id", "attempt", "node", "seq"]
        )
    with op.batch_alter_table("resource_group") as batch_op:
        batch_op.add_column(
            sa.Column("labels", sa.JSON(), server_default=sa.text("'{}'"), nullable=False)
        )
        batch_op.add_column(
            sa.Column(
                "state",
                sa.Enum(
                    "ACTIVE",
                    "DRAINING",
                    "DISABLED",
                    name="groupstate",
                    native_enum=False,
                    length=16,
                ),
                server_default="ACTIVE",
                nullable=False,
            )
        )
        batch_op.add_column(sa.Column("deleted_at", sa.DateTime(), nullable=True))
        batch_op.drop_constraint("uq_resource_group_name", type_="unique")
    op.create_index(
        "uq_resource_group_live_name",
        "resource_group",
        ["name"],
        unique=True,
        postgresql_where=LIVE,
        sqlite_where=LIVE,
    )
    with op.batch_alter_table("sub_task") as batch_op:
        batch_op.add_column(_attempt())
        batch_op.add_column(sa.Column("dispatched_at", sa.DateTime(), nullable=True))
        batch_op.drop_constraint("uq_sub_task_task_id", type_="unique")
        batch_op.create_unique_constraint(
            "uq_sub_task_task_id", ["task_id", "attempt", "group_index"]
        )
    with op.batch_alter_table("task") as batch_op:
        batch_op.add_column(_attempt())
        batch_op.add_column(
            sa.Column("max_restarts", sa.Integer(), server_default="2", nullable=False)
        )
        batch_op.add_column(
            sa.Column("waiting", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
    op.create_index(
        "ix_task_queue",
        "task",
        [sa.text("priority DESC"), "id"],
        postgresql_where=QUEUED,
        sqlite_where=QUEUED,
    )
    with op.batch_alter_table("task_event") as batch_op:
        batch_op.add_column(
            sa.Column(
                "kind",
                sa.Enum("STATUS", "ALARM", name="eventkind", native_enum=False, length=16),
                server_default="STATUS",
                nullable=False,
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("task_event") as batch_op:
        batch_op.drop_column("kind")
    op.drop_index("ix_task_queue", table_name="task")
    with op.batch_alter_table("task") as batch_op:
        for column in ("waiting", "max_restarts", "attempt"):
            batch_op.drop_column(column)
    with op.batch_alter_table("sub_task") as batch_op:
        batch_op.drop_constraint("uq_sub_task_task_id", type_="unique")
        batch_op.create_unique_constraint("uq_sub_task_task_id", ["task_id", "resource_group_id"])
        batch_op.drop_column("dispatched_at")
        batch_op.drop_column("attempt")
    op.drop_index("uq_resource_group_live_name", table_name="resource_group")
    with op.batch_alter_table("resource_group") as batch_op:
        batch_op.create_unique_constraint("uq_resource_group_name", ["name"])
        for column in ("deleted_at", "state", "labels"):
            batch_op.drop_column(column)
    with op.batch_alter_table("log_line") as batch_op:
        batch_op.drop_constraint("uq_log_line_task_id", type_="unique")
        batch_op.create_unique_constraint("uq_log_line_task_id", ["task_id", "node", "seq"])
        batch_op.drop_column("attempt")
    op.drop_index("ix_allocation_held", table_name="allocation")
    for table in ("checkpoint", "allocation"):
        with op.batch_alter_table(table) as batch_op:
            batch_op.drop_column("attempt")
    op.drop_index(op.f("ix_task_dependency_depends_on_id"), table_name="task_dependency")
    op.drop_table("task_dependency")
