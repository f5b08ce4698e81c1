"""Typed FastAPI dependency aliases shared by the routers."""

from typing import Annotated

from fastapi import Depends, Header
from sqlalchemy.orm import Session

from backend.core.config import Settings, get_settings
from backend.core.db import get_session
from backend.core.errors import ServiceError

SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


class Unauthorized(ServiceError):
    status = 401
    code = "unauthorized"


def require_agent_token(
    settings: SettingsDep, authorization: Annotated[str | None, Header()] = None
) -> None:
    """Check the `Authorization: Bearer <agent token>` header of the internal API.

    Raises:
        Unauthorized: the header is missing or carries another token.
    """
    expected = settings.agent_token.get_secret_value()
    if authorization != f"Bearer {expected}":
        raise Unauthorized("missing or wrong agent token (Authorization: Bearer <token>)")


AgentAuth = Depends(require_agent_token)
