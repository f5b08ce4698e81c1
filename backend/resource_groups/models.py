"""Resource groups: pools of identical hardware."""

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Enum, Index, String, Text, text
from sqlalchemy.orm import Mapped, mapped_column

from backend.core.db import Base, utcnow


class GroupState(enum.StrEnum):
    """`active` takes new tasks; `draining` finishes its running tasks and takes no new
    ones; `disabled` runs nothing (only reachable once nothing runs on it)."""

    ACTIVE = "active"
    DRAINING = "draining"
    DISABLED = "disabled"


class ResourceGroup(Base):
    """A pool of identical hardware (same device type and model).

    `accepted_models` are the device models its agents may report (an agent of another
    model is refused); empty, the first agent's model is adopted, pinning the group to it.
    An admin widens a group by adding models (docs/architecture.md, "Homogeneous groups").

    `capacity` is the most compute workers the group runs at once; what it can
    run now also depends on the agents online. `labels` are free key/value
    tags a request can select on. A deleted group keeps its row (`deleted_at`)
    so that finished tasks still name it; its name can be reused.
    """

    __tablename__ = "resource_group"
    __table_args__ = (
        Index(
            "uq_resource_group_live_name",
            "name",
            unique=True,
            postgresql_where=text("deleted_at IS NULL"),
            sqlite_where=text("deleted_at IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    device_type: Mapped[str] = mapped_column(String(16))
    description: Mapped[str] = mapped_column(Text, default="")
    capacity: Mapped[int]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    accepted_models: Mapped[list[str]] = mapped_column(JSON, default=list)
    state: Mapped[GroupState] = mapped_column(
        Enum(GroupState, native_enum=False, length=16, validate_strings=True),
        default=GroupState.ACTIVE,
        server_default="ACTIVE",
    )
    deleted_at: Mapped[datetime | None] = mapped_column(default=None)


LIVE = ResourceGroup.deleted_at.is_(None)  # not deleted (deleted groups keep their rows)
