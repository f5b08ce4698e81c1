"""Types shared by the API's schemas, and the NUL check of inputs that are not JSON bodies.

Request bodies (REST and internal) derive from `contracts.strict.StrictModel`: an unknown
field is refused by name and no string may hold a NUL character. `refuse_nul_inputs`, an
app-wide dependency, refuses NUL in path and query parameters and form fields.
Response models derive from plain `BaseModel`.
"""

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import Request, params
from pydantic import PlainSerializer, WithJsonSchema
from starlette.datastructures import UploadFile

from backend.core.errors import Invalid
from contracts.strict import NUL, NUL_MESSAGE


def _utc_iso(value: datetime) -> str:
    """A stored (naive UTC) or aware time as RFC 3339 in UTC: `2026-11-22T06:00:00.5Z`."""
    aware = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    return aware.isoformat().replace("+00:00", "Z")


# The database keeps naive UTC times; answers state the zone, as OpenAPI's date-time requires.
UtcDateTime = Annotated[
    datetime,
    PlainSerializer(_utc_iso, return_type=str, when_used="json"),
    WithJsonSchema(
        {"type": "string", "format": "date-time", "examples": ["2026-11-22T06:00:00Z"]},
        mode="serialization",
    ),
]


def _form_route(request: Request) -> bool:
    """True if the matched route reads its body as a form (FastAPI parsed it already)."""
    body = getattr(request.scope.get("route"), "body_field", None)
    return body is not None and isinstance(body.field_info, params.Form)


async def refuse_nul_inputs(request: Request) -> None:
    """An app-wide dependency: refuse a NUL character in any path parameter, query
    parameter or form field (name, value or upload file name), naming the field.

    JSON bodies are checked by their models (`StrictModel`), field by field.

    Raises:
        Invalid: 422 with `field` the parameter that holds a NUL.
    """
    pairs: list[tuple[str, Any]] = list(request.path_params.items())
    pairs += request.query_params.multi_items()
    if _form_route(request):
        pairs += (await request.form()).multi_items()
    for name, value in pairs:
        text = (value.filename or "") if isinstance(value, UploadFile) else value
        if NUL in name or (isinstance(text, str) and NUL in text):
            field = name.replace(NUL, "\\x00")
            raise Invalid(f"{field}: {NUL_MESSAGE}", field=field)
