"""Resource groups: pools of identical hardware."""

from datetime import datetime

from sqlalchemy import String, Text
from sqlalchemy.orm import Mapped, mapped_column

from backend.core.db import Base, utcnow


class ResourceGroup(Base):
    """A pool of identical hardware (same device type and model).

    `capacity` is the most compute workers the group runs at once.
    """

    __tablename__ = "resource_group"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    device_type: Mapped[str] = mapped_column(String(16))
    description: Mapped[str] = mapped_column(Text, default="")
    capacity: Mapped[int]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    @property
    def queue(self) -> str:
        """The Celery queue that this group's agents consume."""
        return f"rg.{self.name}"
