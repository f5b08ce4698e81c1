from fastapi import APIRouter

from backend.agents import service
from backend.agents.schemas import AgentRead
from backend.core.deps import SessionDep

router = APIRouter(prefix="/agents", tags=["agents"])


@router.get("", response_model=list[AgentRead])
def list_agents(session: SessionDep) -> list:
    return list(service.list_all(session))
