"""What the audit log answers and how it is filtered."""

from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from backend.audit.models import AuditOutcome
from backend.core.schemas import UtcDateTime


class AuditEventCreate(BaseModel):
    """One event as the audit middleware records it."""

    actor_user_id: int | None = None
    actor_token_id: int | None = None
    action: str = Field(max_length=64)
    object_type: str | None = Field(default=None, max_length=32)
    object_id: str | None = Field(default=None, max_length=100)
    method: str = Field(max_length=8)
    path: str = Field(max_length=500)
    status_code: int
    outcome: AuditOutcome
    client_address: str | None = Field(default=None, max_length=64)
    request_id: str = Field(max_length=64)


class AuditEventRead(BaseModel):
    model_config = ConfigDict(
        from_attributes=True,
        json_schema_extra={
            "examples": [
                {
                    "id": 41,
                    "at": "2026-11-25T09:30:00Z",
                    "actor_user_id": 2,
                    "actor_token_id": 5,
                    "action": "project.archive",
                    "object_type": "project",
                    "object_id": "7",
                    "method": "POST",
                    "path": "/api/v1/projects/7/archive",
                    "status_code": 403,
                    "outcome": "refused",
                    "client_address": "10.0.0.8",
                    "request_id": "6f1c2a0e9b7d4c3a8e5f0a1b2c3d4e5f",
                }
            ]
        },
    )

    id: int
    at: UtcDateTime = Field(description="when the request was answered (UTC)")
    actor_user_id: int | None = Field(description="the caller; empty if not authenticated")
    actor_token_id: int | None = Field(
        description="the personal API token used; empty for the portal's session cookie"
    )
    action: str = Field(description="`<object type>.<verb>`, e.g. `project.create`")
    object_type: str | None
    object_id: str | None = Field(description="id (or name, for resource groups)")
    method: str
    path: str
    status_code: int
    outcome: AuditOutcome
    client_address: str | None
    request_id: str = Field(description="also sent to the caller as `X-Request-ID`")


def _naive_utc(value: datetime | None) -> datetime | None:
    if value is None or value.tzinfo is None:
        return value
    return value.astimezone(UTC).replace(tzinfo=None)


class AuditFilter(BaseModel):
    """Which events to list; every given filter must match. Times without a zone are UTC."""

    actor_user_id: int | None = Field(default=None, ge=1, description="the acting user's id")
    actor_token_id: int | None = Field(default=None, ge=1, description="the API token's id")
    action: str | None = Field(
        default=None,
        max_length=64,
        examples=["project.archive"],
        description="exact action, or a prefix ending in `*` (`project.*`)",
    )
    object_type: str | None = Field(default=None, max_length=32, examples=["project"])
    object_id: str | None = Field(default=None, max_length=100, examples=["7"])
    outcome: AuditOutcome | None = None
    status_code: int | None = Field(default=None, ge=100, le=599)
    client_address: str | None = Field(default=None, max_length=64)
    request_id: str | None = Field(default=None, max_length=64)
    since: datetime | None = Field(default=None, description="at or after this time")
    until: datetime | None = Field(default=None, description="before this time")

    @field_validator("since", "until")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        return _naive_utc(value)

    @field_validator("until")
    @classmethod
    def _after_since(cls, value: datetime | None, info: ValidationInfo) -> datetime | None:
        since = info.data.get("since")
        if value is not None and since is not None and value <= since:
            raise ValueError("must be after since")
        return value
