"""Projects and their immutable code versions."""

from datetime import datetime

from sqlalchemy import ForeignKey, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from backend.core.db import Base, utcnow


class Project(Base):
    __tablename__ = "project"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    description: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class CodeVersion(Base):
    """One immutable version of a project's training module.

    `source` is `example:NAME` for a bundled example, or `upload` for a file
    stored under the service's code directory at `path`.
    """

    __tablename__ = "code_version"
    __table_args__ = (UniqueConstraint("project_id", "version"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(
        ForeignKey("project.id", ondelete="CASCADE"), index=True
    )
    version: Mapped[int]
    source: Mapped[str] = mapped_column(String(200))
    filename: Mapped[str] = mapped_column(String(200))
    path: Mapped[str | None] = mapped_column(String(500), default=None)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
