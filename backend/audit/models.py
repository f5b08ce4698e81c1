"""The audit log's one table: an append-only record of write requests."""

import enum
from datetime import datetime

from sqlalchemy import Enum, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from backend.core.db import Base, utcnow


class AuditOutcome(enum.StrEnum):
    """How a write request ended: done (`ok`, 1xx-3xx), `refused` (4xx, or a portal redirect
    to the login page or with an error message) or `failed` (5xx, a fault of the service)."""

    OK = "ok"
    REFUSED = "refused"
    FAILED = "failed"


class AuditEvent(Base):
    """One write request (or refused request) to /api/v1 or the portal.

    The actor ids are plain columns, not foreign keys: the log must keep naming who did
    what even if the user or token row goes away. `actor_token_id` is set for requests
    authenticated with a personal API token and empty for the portal's session cookie;
    both are empty when the caller could not be authenticated. `object_id` is text because
    some objects are addressed by name (resource groups).
    """

    __tablename__ = "audit_event"
    __table_args__ = (
        Index("ix_audit_event_actor_user_id_at", "actor_user_id", "at"),
        Index("ix_audit_event_action_at", "action", "at"),
        Index("ix_audit_event_object_type_object_id_at", "object_type", "object_id", "at"),
        Index("ix_audit_event_outcome_at", "outcome", "at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    actor_user_id: Mapped[int | None] = mapped_column(default=None)
    actor_token_id: Mapped[int | None] = mapped_column(default=None, index=True)
    action: Mapped[str] = mapped_column(String(64))
    object_type: Mapped[str | None] = mapped_column(String(32), default=None)
    object_id: Mapped[str | None] = mapped_column(String(100), default=None)
    method: Mapped[str] = mapped_column(String(8))
    path: Mapped[str] = mapped_column(String(500))
    status_code: Mapped[int]
    outcome: Mapped[AuditOutcome] = mapped_column(
        Enum(AuditOutcome, native_enum=False, length=16, validate_strings=True)
    )
    client_address: Mapped[str | None] = mapped_column(String(64), default=None)
    request_id: Mapped[str] = mapped_column(String(64), index=True)
