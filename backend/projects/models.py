"""Projects and their immutable code versions."""

from datetime import datetime

from sqlalchemy import ForeignKey, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from backend.core.db import Base, utcnow


class Project(Base):
    """A user's container of code versions and tasks; names are unique per owner.

    An archived project (`archived_at` set) is read-only: no new code or tasks.
    """

    __tablename__ = "project"
    __table_args__ = (UniqueConstraint("owner_id", "name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    description: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    owner_id: Mapped[int | None] = mapped_column(
        ForeignKey("user.id", ondelete="SET NULL"), index=True, default=None
    )
    archived_at: Mapped[datetime | None] = mapped_column(default=None)


class ProjectMember(Base):
    """A user other than the owner who may read the project and submit its tasks."""

    __tablename__ = "project_member"
    __table_args__ = (UniqueConstraint("project_id", "user_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(
        ForeignKey("project.id", ondelete="CASCADE"), index=True
    )
    user_id: Mapped[int] = mapped_column(ForeignKey("user.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class CodeVersion(Base):
    """One immutable version of a project's training module.

    `source` is `example:NAME` for a bundled example, `upload` for a module
    stored under the service's code directory at `path`, or `archive` for a zip
    stored at `path` whose module `entrypoint` (a path inside it) holds the contract.

    `requirements` are the Python packages the code declares (a requirements text beside a
    module, or an archive's requirements.txt / pyproject.toml dependencies), as declared;
    `lock` is what the portal resolved them to at upload (exact pins with hashes of the
    packages the platform lacks, backend.projects.requirements) and `lock_hash` its sha256,
    the name of its environment on the agents. No lock: the platform's packages only.

    `uploaded_by_id` is the user who added the version (none for versions made before it
    was recorded, or once that account is deleted).
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
    entrypoint: Mapped[str | None] = mapped_column(String(300), default=None)
    requirements: Mapped[str | None] = mapped_column(Text, default=None)
    lock: Mapped[str | None] = mapped_column(Text, default=None)
    lock_hash: Mapped[str | None] = mapped_column(String(64), default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    uploaded_by_id: Mapped[int | None] = mapped_column(
        ForeignKey("user.id", ondelete="SET NULL"), index=True, default=None
    )
