"""every API token expires: tokens made without an expiry get the default one (90 days
from this upgrade), as tokens created from now on do

Revision ID: a7c3e5f9b2d4
Revises: a7d3c9e1f2b4
Create Date: 2026-11-25 11:40:00
"""

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from alembic import op

revision: str = "a7c3e5f9b2d4"
down_revision: str | None = "a7d3c9e1f2b4"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DEFAULT_EXPIRY = timedelta(days=90)  # POLYTRAIN_TOKEN_DEFAULT_EXPIRY_DAYS' default


def upgrade() -> None:
    expires = datetime.now(UTC).replace(tzinfo=None) + DEFAULT_EXPIRY
    token = sa.table(
        "api_token", sa.column("expires_at", sa.DateTime()), sa.column("revoked_at", sa.DateTime())
    )
    op.execute(
        token.update()
        .where(token.c.expires_at.is_(None), token.c.revoked_at.is_(None))
        .values(expires_at=expires)
    )


def downgrade() -> None:
    pass  # which tokens had no expiry is not kept; an expiry stays harmless
