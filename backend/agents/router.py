from fastapi import APIRouter, Response

from backend.agents import service
from backend.agents.schemas import AgentRead
from backend.core.deps import AdminWrites, SessionDep
from backend.core.pagination import Page, paginated

# Every user sees the agents; only admins change them.
router = APIRouter(prefix="/agents", tags=["agents"], dependencies=[AdminWrites])


@router.get("", response_model=list[AgentRead])
def list_agents(session: SessionDep, page: Page, response: Response,
                resource_group: str | None = None, online: bool | None = None) -> list:
    """Registered agents with the hardware they detected; filter by group or liveness."""
    return paginated(list(service.list_all(session, group=resource_group, online=online)),
                     page, response)
