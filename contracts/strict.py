"""The strictness every request input gets: unknown fields and NUL characters are refused.

Request bodies (REST and internal) derive from `StrictModel`: an unknown field is
refused by name and no string may hold a NUL character. Response models derive from
plain `BaseModel`.
"""

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic_core import PydanticCustomError

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
        raise PydanticCustomError(
            "nul_character", "{where}" + NUL_MESSAGE, {"where": f"{where} " if where else ""}
        )
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
