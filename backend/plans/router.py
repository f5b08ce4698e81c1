"""REST for plans: start one (its trial task), read its predictions, cancel its trial.

Every route checks that the caller may see the plan's project (adding one: write to it).
"""

from typing import Annotated

from fastapi import APIRouter, Depends, Response, status

from backend.auth.dependencies import CurrentUser, UserAuth
from backend.core.db import release
from backend.core.dependencies import SessionDep
from backend.core.errors import NotFound
from backend.core.pagination import Page, paginated
from backend.plans import service
from backend.plans.models import Plan
from backend.plans.schemas import PlanCreate, PlanRead
from backend.projects import access as project_access
from backend.projects.models import Project

router = APIRouter(prefix="/plans", tags=["plans"], dependencies=[UserAuth])


def valid_plan(plan_id: int, session: SessionDep, user: CurrentUser) -> Plan:
    """A plan of a project the caller may see (404 otherwise)."""
    plan = session.get(Plan, plan_id)
    if plan is None or not project_access.can_read(
        session, user=user, project=session.get_one(Project, plan.project_id)
    ):
        raise NotFound(f"plan {plan_id} does not exist", field="plan_id")
    return plan


PlanDep = Annotated[Plan, Depends(valid_plan)]


@router.post("", response_model=PlanRead, status_code=status.HTTP_201_CREATED)
def create_plan(data: PlanCreate, session: SessionDep, user: CurrentUser) -> PlanRead:
    """Start a plan: a short trial task on every candidate group at once times the task's
    own model (step at three local batch sizes, under diloco also at each group's share of
    the global batch; exchanges at two sizes); once it reports, `GET /plans/{id}` predicts
    every subset of the groups and recommends one."""
    project_access.writable_project(session, user=user, project_id=data.project_id)
    project_access.readable_version(session, user=user, version_id=data.code_version_id)
    return service.read(session, plan=service.create(session, data=data))


@router.get("", response_model=list[PlanRead])
def list_plans(
    session: SessionDep, user: CurrentUser, page: Page, response: Response
) -> list[PlanRead]:
    """Plans of the projects the caller may see, newest first, without their predictions
    (`GET /plans/{id}` gives them)."""
    ids = project_access.visible_project_ids(session, user=user)
    plans = paginated(list(service.list_plans(session, project_ids=ids)), page, response)
    found = [service.read(session, plan=p, detail=False) for p in plans]
    release(session)
    return found


@router.get("/{plan_id}", response_model=PlanRead)
def get_plan(plan: PlanDep, session: SessionDep) -> PlanRead:
    """The plan; once its trial reported (`status: ready`), its predictions and
    recommendation."""
    found = service.read(session, plan=plan)
    release(session)
    return found


@router.post("/{plan_id}/cancel", response_model=PlanRead)
def cancel_plan(plan: PlanDep, session: SessionDep) -> PlanRead:
    """Cancel the plan's trial task (409 once it has ended)."""
    return service.read(session, plan=service.cancel(session, plan=plan))
