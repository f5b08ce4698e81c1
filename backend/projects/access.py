"""Who may see and change a project and its code versions (the policy: docs/architecture.md,
Access). One place for these rules, used by REST and the portal; the task rules build on
them (`backend/tasks/access.py`)."""

from typing import Protocol, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.auth.models import User
from backend.core.errors import Conflict, Forbidden, NotFound
from backend.projects.models import CodeVersion, Project, ProjectMember


def is_member(session: Session, *, user: User, project: Project) -> bool:
    """Whether `user` owns the project or is one of its members."""
    if project.owner_id == user.id:
        return True
    query = select(ProjectMember.id).where(
        ProjectMember.project_id == project.id, ProjectMember.user_id == user.id
    )
    return session.scalar(query) is not None


def can_read(session: Session, *, user: User, project: Project) -> bool:
    return user.is_admin or is_member(session, user=user, project=project)


def can_manage(user: User, project: Project) -> bool:
    """Whether `user` may edit, archive and share the project."""
    return user.is_admin or project.owner_id == user.id


def visible_project_ids(session: Session, *, user: User) -> list[int] | None:
    """Ids of the projects `user` may see; None means every project (an admin)."""
    if user.is_admin:
        return None
    owned = select(Project.id).where(Project.owner_id == user.id)
    shared = select(ProjectMember.project_id).where(ProjectMember.user_id == user.id)
    return sorted(set(session.scalars(owned)) | set(session.scalars(shared)))


def readable_project(session: Session, *, user: User, project_id: int) -> Project:
    """The project, if `user` may see it. Raises NotFound otherwise."""
    project = session.get(Project, project_id)
    if project is None or not can_read(session, user=user, project=project):
        raise NotFound(f"project {project_id} does not exist", field="project_id")
    return project


def writable_project(session: Session, *, user: User, project_id: int) -> Project:
    """The project, if `user` may add code and tasks to it now.

    Raises:
        NotFound: no such project, or not visible to `user`.
        Conflict: the project is archived.
    """
    project = readable_project(session, user=user, project_id=project_id)
    if project.archived_at is not None:
        raise Conflict(
            f"project '{project.name}' is archived; unarchive it first", field="project_id"
        )
    return project


def managed_project(session: Session, *, user: User, project_id: int) -> Project:
    """The project, if `user` may edit, archive or share it.

    Raises:
        NotFound: no such project, or not visible to `user`.
        Forbidden: a member who is not the owner.
    """
    project = readable_project(session, user=user, project_id=project_id)
    if not can_manage(user, project):
        raise Forbidden("only the project's owner or an admin may change the project")
    return project


class InProject(Protocol):
    """A row that belongs to a project: a code version, a task, a sweep."""

    @property
    def project_id(self) -> int: ...


Row = TypeVar("Row", bound=InProject)


def readable_in_project(
    session: Session, *, user: User, model: type[Row], row_id: int, noun: str, field: str
) -> Row:
    """The `model` row `row_id`, if `user` may see its project. Raises NotFound otherwise, with
    `noun` and `field`: one that exists in a project `user` may not see gets the answer of one
    that does not exist."""
    row = session.get(model, row_id)
    if row is None or not can_read(
        session, user=user, project=session.get_one(Project, row.project_id)
    ):
        raise NotFound(f"{noun} {row_id} does not exist", field=field)
    return row


def readable_version(session: Session, *, user: User, version_id: int) -> CodeVersion:
    """The code version, if `user` may see its project. Raises NotFound otherwise."""
    return readable_in_project(
        session,
        user=user,
        model=CodeVersion,
        row_id=version_id,
        noun="code version",
        field="code_version_id",
    )
