from fastapi import APIRouter, Response

from backend.agents import service
from backend.agents.models import Agent
from backend.agents.schemas import AgentRead, AgentUpdate
from backend.auth.dependencies import AdminWrites
from backend.core.dependencies import SessionDep
from backend.core.pagination import Page, paginated

# Every user sees the agents; only admins change them.
router = APIRouter(prefix="/agents", tags=["agents"], dependencies=[AdminWrites])


@router.get("", response_model=list[AgentRead])
def list_agents(
    session: SessionDep,
    page: Page,
    response: Response,
    resource_group: str | None = None,
    online: bool | None = None,
) -> list:
    """Registered agents with the hardware they detected; filter by group or liveness."""
    return paginated(
        list(service.list_all(session, group=resource_group, online=online)), page, response
    )


@router.get("/{agent_id}", response_model=AgentRead)
def get_agent(agent_id: int, session: SessionDep) -> Agent:
    return service.get(session, agent_id=agent_id)


@router.patch("/{agent_id}", response_model=AgentRead)
def update_agent(agent_id: int, data: AgentUpdate, session: SessionDep) -> Agent:
    """Drain (`{"state": "draining"}`: finish what it runs, claim nothing new), disable once
    idle, re-activate, or describe an agent. Admins only; 409 when disabling an agent
    that still runs sub-tasks."""
    return service.update(session, agent=service.get(session, agent_id=agent_id), data=data)
