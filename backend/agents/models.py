"""Agents: processes serving one resource group's queue on one host."""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from backend.core.db import Base, utcnow


class Agent(Base):
    __tablename__ = "agent"
    __table_args__ = (UniqueConstraint("name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    host: Mapped[str] = mapped_column(String(200))
    resource_group_id: Mapped[int] = mapped_column(
        ForeignKey("resource_group.id", ondelete="CASCADE"), index=True
    )
    workers: Mapped[int]
    hardware: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    online: Mapped[bool] = mapped_column(default=True)
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
