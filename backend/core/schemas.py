"""Types shared by the API's schemas."""

from datetime import UTC, datetime
from typing import Annotated

from pydantic import PlainSerializer, WithJsonSchema


def _utc_iso(value: datetime) -> str:
    """A stored (naive UTC) or aware time as RFC 3339 in UTC: `2026-11-22T06:00:00.5Z`."""
    aware = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    return aware.isoformat().replace("+00:00", "Z")


# The database keeps naive UTC times; answers state the zone, as OpenAPI's date-time requires.
UtcDateTime = Annotated[
    datetime,
    PlainSerializer(_utc_iso, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "format": "date-time", "examples": ["2026-11-22T06:00:00Z"]},
                   mode="serialization"),
]
