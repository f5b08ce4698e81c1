"""initial schema

Revision ID: e999bfef3daf
Revises:
Create Date: 2026-11-22 05:33:01.973742
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "e999bfef3daf"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "project",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_project")),
        sa.UniqueConstraint("name", name=op.f("uq_project_name")),
    )
    op.create_table(
        "resource_group",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("device_type", sa.String(length=16), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("capacity", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_resource_group")),
        sa.UniqueConstraint("name", name=op.f("uq_resource_group_name")),
    )
    op.create_table(
        "agent",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("host", sa.String(length=200), nullable=False),
        sa.Column("resource_group_id", sa.Integer(), nullable=False),
        sa.Column("workers", sa.Integer(), nullable=False),
        sa.Column("hardware", sa.JSON(), nullable=False),
        sa.Column("online", sa.Boolean(), nullable=False),
        sa.Column("registered_at", sa.DateTime(), nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["resource_group_id"],
            ["resource_group.id"],
            name=op.f("fk_agent_resource_group_id_resource_group"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_agent")),
        sa.UniqueConstraint("name", name=op.f("uq_agent_name")),
    )
    with op.batch_alter_table("agent", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_agent_resource_group_id"), ["resource_group_id"], unique=False
        )

    op.create_table(
        "code_version",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("source", sa.String(length=200), nullable=False),
        sa.Column("filename", sa.String(length=200), nullable=False),
        sa.Column("path", sa.String(length=500), nullable=True),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["project.id"],
            name=op.f("fk_code_version_project_id_project"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_code_version")),
        sa.UniqueConstraint("project_id", "version", name=op.f("uq_code_version_project_id")),
    )
    with op.batch_alter_table("code_version", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_code_version_project_id"), ["project_id"], unique=False
        )

    op.create_table(
        "task",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("code_version_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "QUEUED",
                "SCHEDULED",
                "RUNNING",
                "SUCCEEDED",
                "FAILED",
                "CANCELLED",
                "RESTARTING",
                name="taskstatus",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("status_reason", sa.Text(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("progress", sa.Float(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("master_addr", sa.String(length=200), nullable=True),
        sa.Column("master_port", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["code_version_id"],
            ["code_version.id"],
            name=op.f("fk_task_code_version_id_code_version"),
        ),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["project.id"],
            name=op.f("fk_task_project_id_project"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_task")),
    )
    with op.batch_alter_table("task", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_task_project_id"), ["project_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_task_status"), ["status"], unique=False)

    op.create_table(
        "allocation",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.Integer(), nullable=False),
        sa.Column(
            "role",
            sa.Enum(
                "TASK_MANAGER", "PARAMETER_SERVER", "COMPUTE", name="noderole", native_enum=False
            ),
            nullable=False,
        ),
        sa.Column("resource_group_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("host", sa.String(length=200), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("released_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["resource_group_id"],
            ["resource_group.id"],
            name=op.f("fk_allocation_resource_group_id_resource_group"),
        ),
        sa.ForeignKeyConstraint(
            ["task_id"], ["task.id"], name=op.f("fk_allocation_task_id_task"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_allocation")),
    )
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_allocation_released_at"), ["released_at"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_allocation_resource_group_id"), ["resource_group_id"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_allocation_task_id"), ["task_id"], unique=False)

    op.create_table(
        "checkpoint",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(length=500), nullable=False),
        sa.Column("size_bytes", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["task_id"], ["task.id"], name=op.f("fk_checkpoint_task_id_task"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoint")),
    )
    with op.batch_alter_table("checkpoint", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_checkpoint_task_id"), ["task_id"], unique=False)

    op.create_table(
        "log_line",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("time", sa.DateTime(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["task_id"], ["task.id"], name=op.f("fk_log_line_task_id_task"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_log_line")),
        sa.UniqueConstraint("task_id", "node", "seq", name=op.f("uq_log_line_task_id")),
    )
    with op.batch_alter_table("log_line", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_log_line_task_id"), ["task_id"], unique=False)

    op.create_table(
        "metric",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["task_id"], ["task.id"], name=op.f("fk_metric_task_id_task"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_metric")),
    )
    with op.batch_alter_table("metric", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_metric_task_id"), ["task_id"], unique=False)

    op.create_table(
        "sub_task",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.Integer(), nullable=False),
        sa.Column("resource_group_id", sa.Integer(), nullable=False),
        sa.Column("group_index", sa.Integer(), nullable=False),
        sa.Column("workers", sa.Integer(), nullable=False),
        sa.Column("hosts_parameter_server", sa.Boolean(), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "PENDING",
                "RUNNING",
                "SUCCEEDED",
                "FAILED",
                name="subtaskstatus",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("agent_id", sa.Integer(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["agent_id"], ["agent.id"], name=op.f("fk_sub_task_agent_id_agent"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["resource_group_id"],
            ["resource_group.id"],
            name=op.f("fk_sub_task_resource_group_id_resource_group"),
        ),
        sa.ForeignKeyConstraint(
            ["task_id"], ["task.id"], name=op.f("fk_sub_task_task_id_task"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sub_task")),
        sa.UniqueConstraint("task_id", "resource_group_id", name=op.f("uq_sub_task_task_id")),
    )
    with op.batch_alter_table("sub_task", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_sub_task_task_id"), ["task_id"], unique=False)

    op.create_table(
        "task_event",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.Integer(), nullable=False),
        sa.Column(
            "from_status",
            sa.Enum(
                "QUEUED",
                "SCHEDULED",
                "RUNNING",
                "SUCCEEDED",
                "FAILED",
                "CANCELLED",
                "RESTARTING",
                name="taskstatus",
                native_enum=False,
                length=16,
            ),
            nullable=True,
        ),
        sa.Column(
            "to_status",
            sa.Enum(
                "QUEUED",
                "SCHEDULED",
                "RUNNING",
                "SUCCEEDED",
                "FAILED",
                "CANCELLED",
                "RESTARTING",
                name="taskstatus",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["task_id"], ["task.id"], name=op.f("fk_task_event_task_id_task"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_task_event")),
    )
    with op.batch_alter_table("task_event", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_task_event_task_id"), ["task_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("task_event", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_task_event_task_id"))

    op.drop_table("task_event")
    with op.batch_alter_table("sub_task", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_sub_task_task_id"))

    op.drop_table("sub_task")
    with op.batch_alter_table("metric", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_metric_task_id"))

    op.drop_table("metric")
    with op.batch_alter_table("log_line", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_log_line_task_id"))

    op.drop_table("log_line")
    with op.batch_alter_table("checkpoint", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_checkpoint_task_id"))

    op.drop_table("checkpoint")
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_allocation_task_id"))
        batch_op.drop_index(batch_op.f("ix_allocation_resource_group_id"))
        batch_op.drop_index(batch_op.f("ix_allocation_released_at"))

    op.drop_table("allocation")
    with op.batch_alter_table("task", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_task_status"))
        batch_op.drop_index(batch_op.f("ix_task_project_id"))

    op.drop_table("task")
    with op.batch_alter_table("code_version", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_code_version_project_id"))

    op.drop_table("code_version")
    with op.batch_alter_table("agent", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_agent_resource_group_id"))

    op.drop_table("agent")
    op.drop_table("resource_group")
    op.drop_table("project")
