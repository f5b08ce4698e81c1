"""Projects and code versions."""

import hashlib

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend.core.config import Settings
from backend.core.errors import Conflict, Invalid, NotFound
from backend.projects.code import check_contract, example_path
from backend.projects.models import CodeVersion, Project
from backend.projects.schemas import ProjectCreate


def create(session: Session, *, data: ProjectCreate) -> Project:
    """Create a project. Raises Conflict if the name is taken."""
    if session.scalar(select(Project).where(Project.name == data.name)):
        raise Conflict(f"a project named '{data.name}' already exists", field="name")
    project = Project(**data.model_dump())
    session.add(project)
    session.commit()
    return project


def get(session: Session, *, project_id: int) -> Project:
    project = session.get(Project, project_id)
    if project is None:
        raise NotFound(f"project {project_id} does not exist", field="project_id")
    return project


def list_all(session: Session, *, offset: int = 0, limit: int = 100) -> list[Project]:
    query = select(Project).order_by(Project.id.desc()).offset(offset).limit(limit)
    return list(session.scalars(query))


def _next_version(session: Session, project_id: int) -> int:
    current = session.scalar(
        select(func.max(CodeVersion.version)).where(CodeVersion.project_id == project_id)
    )
    return (current or 0) + 1


def add_example_version(session: Session, *, project: Project, example: str) -> CodeVersion:
    """A new code version holding the bundled example `example`."""
    source = example_path(example).read_bytes()
    version = CodeVersion(
        project_id=project.id, version=_next_version(session, project.id),
        source=f"example:{example}", filename=f"{example}.py",
        sha256=hashlib.sha256(source).hexdigest(),
    )
    session.add(version)
    session.commit()
    return version


def add_uploaded_version(
    session: Session, *, settings: Settings, project: Project, filename: str, content: bytes
) -> CodeVersion:
    """Store an uploaded `.py` module as a new immutable version.

    Raises:
        Invalid: not a .py file, too large, not Python, or missing a contract function.
    """
    if not filename.endswith(".py"):
        raise Invalid(f"{filename!r} is not a Python module (.py)", field="file")
    if len(content) > settings.max_upload_bytes:
        raise Invalid(f"file is {len(content)} bytes; the limit is "
                      f"{settings.max_upload_bytes} bytes", field="file")
    check_contract(content, filename=filename)
    digest = hashlib.sha256(content).hexdigest()
    settings.code_dir.mkdir(parents=True, exist_ok=True)
    path = settings.code_dir / f"{digest}.py"
    path.write_bytes(content)
    version = CodeVersion(
        project_id=project.id, version=_next_version(session, project.id), source="upload",
        filename=filename, path=str(path.resolve()), sha256=digest,
    )
    session.add(version)
    session.commit()
    return version


def get_version(session: Session, *, version_id: int) -> CodeVersion:
    version = session.get(CodeVersion, version_id)
    if version is None:
        raise NotFound(f"code version {version_id} does not exist", field="code_version_id")
    return version


def list_versions(session: Session, *, project_id: int) -> list[CodeVersion]:
    query = select(CodeVersion).where(CodeVersion.project_id == project_id)
    return list(session.scalars(query.order_by(CodeVersion.version.desc())))


def read_source(version: CodeVersion) -> bytes:
    """The module's bytes, for the agents."""
    if version.source.startswith("example:"):
        return example_path(version.source.split(":", 1)[1]).read_bytes()
    assert version.path is not None
    with open(version.path, "rb") as fh:
        return fh.read()
