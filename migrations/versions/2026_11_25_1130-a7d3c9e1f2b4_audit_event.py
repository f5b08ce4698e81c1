"""audit log: one row per write request to the API or the portal, refusals included

Revision ID: a7d3c9e1f2b4
Revises: a9c4e2f1b7d3
Create Date: 2026-11-25 11:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "a7d3c9e1f2b4"
down_revision: str | None = "a9c4e2f1b7d3"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_event",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("actor_user_id", sa.Integer(), nullable=True),
        sa.Column("actor_token_id", sa.Integer(), nullable=True),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("object_type", sa.String(length=32), nullable=True),
        sa.Column("object_id", sa.String(length=100), nullable=True),
        sa.Column("method", sa.String(length=8), nullable=False),
        sa.Column("path", sa.String(length=500), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column(
            "outcome",
            sa.Enum("OK", "REFUSED", "FAILED", name="auditoutcome", native_enum=False, length=16),
            nullable=False,
        ),
        sa.Column("client_address", sa.String(length=64), nullable=True),
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_event")),
    )
    with op.batch_alter_table("audit_event") as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_event_at"), ["at"])
        batch_op.create_index(batch_op.f("ix_audit_event_actor_token_id"), ["actor_token_id"])
        batch_op.create_index(batch_op.f("ix_audit_event_request_id"), ["request_id"])
        batch_op.create_index("ix_audit_event_actor_user_id_at", ["actor_user_id", "at"])
        batch_op.create_index("ix_audit_event_action_at", ["action", "at"])
        batch_op.create_index(
            "ix_audit_event_object_type_object_id_at", ["object_type", "object_id", "at"]
        )
        batch_op.create_index("ix_audit_event_outcome_at", ["outcome", "at"])


def downgrade() -> None:
    op.drop_table("audit_event")
