"""Types shared by the API's schemas, and the strictness every request input gets.

Request bodies (REST and internal) derive from `StrictModel`: an unknown field is
refused by name and no string may hold a NUL character. `refuse_nul_inputs`, an
app-wide dependency, refuses NUL in path and query parameters and form fields.
Response models derive from plain `BaseModel`.
"""

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import Request, params
from pydantic import (
    BaseModel,
    ConfigDict,
    PlainSerializer,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import PydanticCustomError
from starlette.datastructures import UploadFile

from backend.core.errors import Invalid


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


NUL = "\x00"
NUL_MESSAGE = "must not contain NUL characters"


def find_nul(value: Any, path: tuple[str | int, ...] = ()) -> tuple[str | int, ...] | None:
    """Where in `value` (a string, or lists, dicts and models of them) a NUL character
    sits: the path to the first string holding one (`()` for `value` itself), or None."""
    if isinstance(value, str):
        return path if NUL in value else None
    if isinstance(value, NulFreeModel):
        return None  # its own fields were checked when it was validated
    if isinstance(value, BaseModel):
        value = dict(value)
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and NUL in key:
                return (*path, key)
            if (found := find_nul(item, (*path, key))) is not None:
                return found
    elif isinstance(value, list | tuple | set | frozenset):
        for index, item in enumerate(value):
            if (found := find_nul(item, (*path, index))) is not None:
                return found
    return None


def _refuse_nul(value: Any) -> Any:
    """A field validator: raise if any string in the value holds a NUL character."""
    found = find_nul(value)
    if found is not None:
        where = ".".join(map(str, found)).replace(NUL, "\\x00")
        raise PydanticCustomError("nul_character", "{where}" + NUL_MESSAGE,
                                  {"where": f"{where} " if where else ""})
    return value


class NulFreeModel(BaseModel):
    """A model none of whose strings (at any depth) may hold a NUL character.

    PostgreSQL cannot store NUL in text, C libraries cut strings at it, and no
    user means one: refusing it at the edge keeps it out of every store. A NUL
    fails validation at the field that holds it ("must not contain NUL characters").
    """

    @field_validator("*", mode="after")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        return _refuse_nul(value)


class StrictModel(NulFreeModel):
    """The base of every request body (REST and internal): unknown fields are refused
    by name (`split: unknown field (this request has no such field)`) rather than ignored, and
    no string may hold a NUL character."""

    model_config = ConfigDict(extra="forbid")


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
