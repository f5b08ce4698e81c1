"""Typed FastAPI dependency aliases every router shares: the database session and the settings.

Who is calling (users, portal sessions, agents) is decided in `backend/auth/dependencies.py`;
what a caller may see and change, in each domain's `access.py` (docs/architecture.md, Access).
"""

from typing import Annotated

from fastapi import Depends
from sqlalchemy.orm import Session

from backend.core.config import Settings, get_settings
from backend.core.db import get_session

SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
