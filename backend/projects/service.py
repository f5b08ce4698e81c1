"""Projects and code versions."""

import hashlib
import zipfile

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend.auth.models import User
from backend.core.config import Settings, private_dir, private_file
from backend.core.db import utcnow
from backend.core.errors import Conflict, Invalid, NotFound, TooLarge, UnsupportedType
from backend.projects.code import (
    ARCHIVE_SUFFIXES,
    UNKNOWN,
    Declared,
    check_contract,
    example_path,
    loader_module,
    read_archive,
    read_hyperparameters,
)
from backend.projects.models import CodeVersion, Project, ProjectMember
from backend.projects.requirements import (
    MAX_REQUIREMENTS_CHARS,
    declared_requirements,
    requirement_lines,
    resolve,
)
from backend.projects.schemas import ProjectCreate, ProjectUpdate
from contracts.packages import lock_hash


def _check_name_free(
    session: Session, *, name: str, owner_id: int | None, project_id: int | None = None
) -> None:
    query = select(Project.id).where(Project.name == name, Project.owner_id == owner_id)
    found = session.scalar(query)
    if found is not None and found != project_id:
        raise Conflict(f"a project named '{name}' already exists", field="name")


def create(session: Session, *, data: ProjectCreate, owner_id: int | None = None) -> Project:
    """Create a project owned by `owner_id`. Raises Conflict if the owner has that name."""
    _check_name_free(session, name=data.name, owner_id=owner_id)
    project = Project(**data.model_dump(), owner_id=owner_id)
    session.add(project)
    session.commit()
    return project


def update(session: Session, *, project: Project, data: ProjectUpdate) -> Project:
    """Rename or re-describe a project. Raises Conflict if the owner has that name."""
    changes = data.model_dump(exclude_unset=True, exclude_none=True)
    if "name" in changes:
        _check_name_free(
            session, name=changes["name"], owner_id=project.owner_id, project_id=project.id
        )
    for key, value in changes.items():
        setattr(project, key, value)
    session.commit()
    return project


def set_archived(session: Session, *, project: Project, archived: bool) -> Project:
    """Archive (read-only: no new code or tasks) or unarchive a project; idempotent."""
    if archived and project.archived_at is None:
        project.archived_at = utcnow()
    elif not archived:
        project.archived_at = None
    session.commit()
    return project


def members(session: Session, *, project_id: int) -> list[ProjectMember]:
    query = select(ProjectMember).where(ProjectMember.project_id == project_id)
    return list(session.scalars(query.order_by(ProjectMember.id)))


def add_member(session: Session, *, project: Project, user_id: int) -> ProjectMember:
    """Share the project with a user. Raises Conflict if they own it or already are one."""
    if user_id == project.owner_id or any(
        m.user_id == user_id for m in members(session, project_id=project.id)
    ):
        raise Conflict("that user is already a member of this project", field="email")
    member = ProjectMember(project_id=project.id, user_id=user_id)
    session.add(member)
    session.commit()
    return member


def share(session: Session, *, project: Project, email: str) -> None:
    """Share the project with the account that has `email`, if there is one.

    An unknown email, the owner's own and an existing member's change nothing and raise
    nothing: the caller's answer must not tell which emails have accounts.
    """
    user = session.scalar(select(User).where(User.email == email.strip().lower()))
    if user is None:
        return
    try:
        add_member(session, project=project, user_id=user.id)
    except Conflict:
        session.rollback()


def remove_member(session: Session, *, project: Project, user_id: int) -> None:
    """Stop sharing the project with a user. Raises NotFound if they are no member."""
    member = next(
        (m for m in members(session, project_id=project.id) if m.user_id == user_id), None
    )
    if member is None:
        raise NotFound(f"user {user_id} is not a member of this project", field="user_id")
    session.delete(member)
    session.commit()


def get(session: Session, *, project_id: int) -> Project:
    project = session.get(Project, project_id)
    if project is None:
        raise NotFound(f"project {project_id} does not exist", field="project_id")
    return project


def _listing(project_ids: list[int] | None, include_archived: bool):  # type: ignore[no-untyped-def]
    query = select(Project)
    if project_ids is not None:
        query = query.where(Project.id.in_(project_ids))
    if not include_archived:
        query = query.where(Project.archived_at.is_(None))
    return query


def list_all(
    session: Session,
    *,
    offset: int = 0,
    limit: int = 100,
    project_ids: list[int] | None = None,
    include_archived: bool = True,
) -> list[Project]:
    """Projects, newest first; only `project_ids` if given, archived ones unless excluded."""
    query = _listing(project_ids, include_archived).order_by(Project.id.desc())
    return list(session.scalars(query.offset(offset).limit(limit)))


def count(
    session: Session, *, project_ids: list[int] | None = None, include_archived: bool = True
) -> int:
    query = _listing(project_ids, include_archived).subquery()
    return session.scalar(select(func.count()).select_from(query)) or 0


def _next_version(session: Session, project_id: int) -> int:
    current = session.scalar(
        select(func.max(CodeVersion.version)).where(CodeVersion.project_id == project_id)
    )
    return (current or 0) + 1


def add_example_version(
    session: Session,
    *,
    project: Project,
    example: str,
    commit: bool = True,
    uploaded_by_id: int | None = None,
) -> CodeVersion:
    """A new code version holding the bundled example `example`, added by the user
    `uploaded_by_id`.

    With `commit=False` the version is only flushed: the caller commits it
    together with what it is made for (a task), or rolls both back.
    """
    source = example_path(example).read_bytes()
    version = CodeVersion(
        project_id=project.id,
        version=_next_version(session, project.id),
        source=f"example:{example}",
        filename=f"{example}.py",
        sha256=hashlib.sha256(source).hexdigest(),
        uploaded_by_id=uploaded_by_id,
    )
    session.add(version)
    session.commit() if commit else session.flush()
    return version


def _check_upload(settings: Settings, filename: str, content: bytes) -> bool:
    """Whether the upload is an archive (else a module); refuses other kinds and sizes."""
    is_archive = filename.lower().endswith(ARCHIVE_SUFFIXES)
    if not filename.endswith(".py") and not is_archive:
        raise UnsupportedType(
            f"{filename!r} is neither a Python module (.py) nor an archive "
            f"({', '.join(ARCHIVE_SUFFIXES)})",
            field="file",
        )
    if len(content) > settings.max_upload_bytes:
        raise TooLarge(
            f"{filename!r} is over the limit of {settings.max_upload_bytes} bytes", field="file"
        )
    return is_archive


def _archive_requirements(files: dict[str, bytes], field: str | None) -> str | None:
    """An archive's own requirements; a requirements field beside it must say the same.

    Raises:
        Invalid: the field differs from the archive's requirements, or is given beside an
            archive that declares none (field `requirements`).
    """
    own = declared_requirements(files)
    if field is None:
        return own
    where = "requirements.txt" if "requirements.txt" in files else "pyproject.toml"
    if own is None:
        raise Invalid(
            "an archive declares its requirements itself: put them in its requirements.txt "
            "(or pyproject.toml's [project] dependencies) and leave the requirements field "
            "empty",
            field="requirements",
        )
    if requirement_lines(own) != requirement_lines(field):
        raise Invalid(
            f"the archive's {where} declares other requirements than the requirements field: "
            f"leave the field empty to use the archive's {where}, or make it the same",
            field="requirements",
        )
    return own


def add_uploaded_version(
    session: Session,
    *,
    settings: Settings,
    project: Project,
    filename: str,
    content: bytes,
    entrypoint: str | None = None,
    requirements: str | None = None,
    uploaded_by_id: int | None = None,
) -> CodeVersion:
    """Store an uploaded `.py` module, or an archive with an entrypoint module, as a new
    immutable version uploaded by the user `uploaded_by_id`; the module (the entrypoint) is
    checked against the contract first.

    `requirements` (a requirements text) declares a module's own packages; an archive
    declares them in its own requirements.txt or pyproject.toml (a `requirements` beside
    it must say the same). They are resolved to a lock now, before anything is stored,
    against `settings.package_index()` (backend.projects.requirements.resolve).

    Raises:
        UnsupportedType: neither a .py file nor a .zip/.tar.gz archive (415).
        TooLarge: over `settings.max_upload_bytes` (413).
        Invalid: not Python, missing a contract function, or a bad archive or entrypoint;
            requirements that are refused or cannot be resolved (field `requirements`) (422).
        Busy: resolving the requirements took too long (503).
    """
    entry = None
    declared = requirements.replace("\r\n", "\n") if requirements and requirements.strip() else None
    if declared and len(declared) > MAX_REQUIREMENTS_CHARS:
        raise Invalid(
            f"requirements are over {MAX_REQUIREMENTS_CHARS} characters", field="requirements"
        )
    if _check_upload(settings, filename, content):
        archive = read_archive(
            content,
            filename=filename,
            entrypoint=entrypoint,
            max_bytes=10 * settings.max_upload_bytes,
        )
        content, entry = archive.content, archive.entrypoint
        declared = _archive_requirements(archive.files, declared)
    else:
        check_contract(content, filename=filename)
    lock = (
        resolve(declared, settings.package_index(), cache_dir=private_dir(settings.uv_cache_dir))
        if declared
        else None
    )
    digest = hashlib.sha256(content).hexdigest()
    path = private_dir(settings.code_dir) / f"{digest}{'.zip' if entry else '.py'}"
    path.write_bytes(content)
    private_file(path)
    version = CodeVersion(
        project_id=project.id,
        version=_next_version(session, project.id),
        source="archive" if entry else "upload",
        filename=filename,
        path=str(path.resolve()),
        sha256=digest,
        entrypoint=entry,
        requirements=declared,
        lock=lock,
        lock_hash=lock_hash(lock) if lock else None,
        uploaded_by_id=uploaded_by_id,
    )
    session.add(version)
    session.commit()
    return version


def get_version(session: Session, *, version_id: int) -> CodeVersion:
    version = session.get(CodeVersion, version_id)
    if version is None:
        raise NotFound(f"code version {version_id} does not exist", field="code_version_id")
    return version


def project_version(session: Session, *, project: Project, version_id: int) -> CodeVersion:
    """The code version `version_id` of `project`. Raises NotFound for another project's."""
    version = session.get(CodeVersion, version_id)
    if version is None or version.project_id != project.id:
        raise NotFound(f"code version {version_id} does not exist", field="version_id")
    return version


def uploader_email(session: Session, version: CodeVersion) -> str | None:
    """The email of the user who added the version; None when not recorded or deleted."""
    if version.uploaded_by_id is None:
        return None
    user = session.get(User, version.uploaded_by_id)
    return user.email if user else None


def list_versions(session: Session, *, project_id: int) -> list[CodeVersion]:
    query = select(CodeVersion).where(CodeVersion.project_id == project_id)
    return list(session.scalars(query.order_by(CodeVersion.version.desc())))


def read_source(version: CodeVersion) -> bytes:
    """The module's bytes, for the agents."""
    if version.source.startswith("example:"):
        return example_path(version.source.split(":", 1)[1]).read_bytes()
    assert version.path is not None
    with open(version.path, "rb") as fh:
        content = fh.read()
    if version.source == "archive" and version.entrypoint:
        return loader_module(content, entrypoint=version.entrypoint, filename=version.filename)
    return content


def declared_hyperparameters(version: CodeVersion) -> Declared:
    """What the version's module (an archive's entrypoint) tells of its `HYPERPARAMETERS`,
    read without running it (`backend.projects.code.Declared`: whether it binds the name at
    all, and its defaults when a literal); `UNKNOWN` when the file cannot be read."""
    try:
        if version.source == "archive" and version.entrypoint and version.path:
            with zipfile.ZipFile(version.path) as archive:
                source = archive.read(version.entrypoint)
        else:
            source = read_source(version)
    except (OSError, KeyError, zipfile.BadZipFile):
        return UNKNOWN
    return read_hyperparameters(source)


def member_rows(session: Session, *, project: Project) -> list[dict]:
    """The owner and every member as `{user_id, email, name, role}`, the owner first."""
    rows = []
    if project.owner_id is not None:
        owner = session.get_one(User, project.owner_id)
        rows.append(
            {"user_id": owner.id, "email": owner.email, "name": owner.name, "role": "owner"}
        )
    for member in members(session, project_id=project.id):
        user = session.get_one(User, member.user_id)
        rows.append({"user_id": user.id, "email": user.email, "name": user.name, "role": "member"})
    return rows
