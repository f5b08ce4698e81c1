"""REST for hyperparameter sweeps: create, list, read (with its trials and the best),
cancel (its unfinished trials too).

Every route checks that the caller may see the sweep's project; creating one needs a
project the caller may add tasks to (not archived), its code version, and every task the
sweep's task depends on (`check_creation`, shared with the portal's form).
"""

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response, status
from sqlalchemy.orm import Session

from backend.auth.dependencies import CurrentUser, UserAuth
from backend.auth.models import User
from backend.core.dependencies import SessionDep
from backend.core.errors import NotFound
from backend.core.pagination import TOTAL_HEADER
from backend.projects import access as project_access
from backend.sweeps import service
from backend.sweeps.models import Sweep, SweepStatus
from backend.sweeps.schemas import SweepCreate, SweepDetail, SweepRead
from backend.tasks import access as task_access

router = APIRouter(prefix="/sweeps", tags=["sweeps"], dependencies=[UserAuth])


def readable_sweep(session: Session, *, user: User, sweep_id: int) -> Sweep:
    """The sweep, if `user` may see its project. Raises NotFound otherwise."""
    return project_access.readable_in_project(
        session, user=user, model=Sweep, row_id=sweep_id, noun="sweep", field="sweep_id"
    )


def check_creation(session: Session, *, user: User, data: SweepCreate) -> None:
    """`user` may start the sweep: add tasks to its project (not archived), see its code
    version and each task its `task.depends_on` names (another user's unshared task is
    answered as a missing one: `backend.tasks.access.check_dependencies`).

    Raises:
        NotFound: the project, the code version or a dependency (field
            `task.depends_on.<index>`) is not visible to `user`.
        Conflict: the project is archived.
        Invalid: the sweep's task is not a valid submission (field `task.<name>`).
    """
    project_access.writable_project(session, user=user, project_id=data.project_id)
    project_access.readable_version(session, user=user, version_id=data.code_version_id)
    base = service.base_task(data)
    try:
        task_access.check_dependencies(session, user=user, depends_on=base.depends_on or [])
    except NotFound as exc:
        raise NotFound(exc.message, field=f"task.{exc.field}") from exc


def valid_sweep(sweep_id: int, session: SessionDep, user: CurrentUser) -> Sweep:
    return readable_sweep(session, user=user, sweep_id=sweep_id)


SweepDep = Annotated[Sweep, Depends(valid_sweep)]


@router.post("", response_model=SweepDetail, status_code=status.HTTP_201_CREATED)
def create_sweep(data: SweepCreate, session: SessionDep, user: CurrentUser) -> dict:
    """Start a sweep: its trials are planned at once and submitted `parallel` at a time."""
    check_creation(session, user=user, data=data)
    sweep = service.create(session, data=data, user_id=user.id)
    return service.detail(session, sweep)


@router.get("", response_model=list[SweepRead])
def list_sweeps(
    session: SessionDep,
    user: CurrentUser,
    response: Response,
    project_id: int | None = None,
    status: SweepStatus | None = None,
    offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> list[dict]:
    """Sweeps of the projects the caller may see, newest first; the total in X-Total-Count."""
    rows, total = service.list_sweeps(
        session,
        project_id=project_id,
        project_ids=project_access.visible_project_ids(session, user=user),
        status=status,
        offset=offset,
        limit=limit,
    )
    response.headers[TOTAL_HEADER] = str(total)
    return [service.summary(sweep) for sweep in rows]


@router.get("/{sweep_id}", response_model=SweepDetail)
def get_sweep(sweep: SweepDep, session: SessionDep) -> dict:
    """A sweep with every trial (hyperparameters, status, objective, curve), the best one
    and the trials still to submit."""
    return service.detail(session, sweep)


@router.post("/{sweep_id}/cancel", response_model=SweepDetail)
def cancel_sweep(sweep: SweepDep, session: SessionDep) -> dict:
    """Cancel a running sweep and its unfinished trials. 409 if it has ended."""
    service.cancel(session, sweep=sweep)
    return service.detail(session, sweep)
