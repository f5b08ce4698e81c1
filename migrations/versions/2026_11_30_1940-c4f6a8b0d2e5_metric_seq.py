"""a metric's place in its node's sequence: a report sent again stores each value once

Revision ID: c4f6a8b0d2e5
Revises: b3e5f7a9c1d4
Create Date: 2026-11-30 19:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "c4f6a8b0d2e5"
down_revision: str | None = "b3e5f7a9c1d4"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NUMBERED = sa.text("seq IS NOT NULL")


def upgrade() -> None:
    with op.batch_alter_table("metric") as batch:
        batch.add_column(sa.Column("attempt", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("node", sa.String(64), nullable=True))
        batch.add_column(sa.Column("seq", sa.Integer(), nullable=True))
    # Partial: the rows already there (all unnumbered) are not indexed, so it starts empty.
    op.create_index(
        "uq_metric_seq",
        "metric",
        ["task_id", "attempt", "node", "seq"],
        unique=True,
        postgresql_where=NUMBERED,
        sqlite_where=NUMBERED,
    )


def downgrade() -> None:
    op.drop_index("uq_metric_seq", table_name="metric")
    with op.batch_alter_table("metric") as batch:
        batch.drop_column("seq")
        batch.drop_column("node")
        batch.drop_column("attempt")
