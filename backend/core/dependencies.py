"""Typed FastAPI dependency aliases every router shares: the database session and the settings.

Who is calling (users, portal sessions, agents) is decided in `backend/auth/dependencies.py`;
what a caller may see and change, in each domain's `access.py` (docs/architecture.md, Access).
"""

from datetime import datetime
from typing import Annotated

from fastapi import Depends
from sqlalchemy.orm import Session

from backend.core.config import Settings, get_settings
from backend.core.db import get_session, utcnow


async def _settings() -> Settings:
    """The process's settings (cached), read on the event loop: FastAPI runs a plain `def`
    dependency in its thread pool, a hop per request for a cached object."""
    return get_settings()


async def _arrival() -> datetime:
    """When the request reached its route (naive UTC), on the event loop: before it waited
    for a worker thread of the pool, which on a busy API process takes seconds."""
    return utcnow()


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(_settings)]
ArrivalDep = Annotated[datetime, Depends(_arrival)]
