"""One JSON error shape for every failure: `{"error": {"code", "message", "field"?}}`."""

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import DataError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """A refused request; `status` is the HTTP status, `field` names the faulty input."""

    status = 400
    code = "bad_request"
    headers: dict[str, str] | None = None

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class Unauthorized(ServiceError):
    """No credentials, or wrong, expired or revoked ones (401)."""

    status = 401
    code = "unauthorized"
    headers = {"WWW-Authenticate": "Bearer"}


class Forbidden(ServiceError):
    """Authenticated, but not allowed to do this (403)."""

    status = 403
    code = "forbidden"


class NotFound(ServiceError):
    status = 404
    code = "not_found"


class Conflict(ServiceError):
    status = 409
    code = "conflict"


class Invalid(ServiceError):
    status = 422
    code = "invalid"


class TooLarge(ServiceError):
    status = 413
    code = "too_large"


class UnsupportedType(ServiceError):
    status = 415
    code = "unsupported_type"


class TooManyRequests(ServiceError):
    """Rate limited (429); `Retry-After` says in how many whole seconds to try again."""

    status = 429
    code = "too_many_requests"

    def __init__(self, message: str, *, retry_after_s: int, field: str | None = None) -> None:
        super().__init__(message, field=field)
        self.headers = {"Retry-After": str(max(1, retry_after_s))}


class Busy(ServiceError):
    """The service is at capacity for this kind of work right now (503, `Retry-After`)."""

    status = 503
    code = "busy"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(max(1, retry_after_s))}


class DatabaseUnavailable(Busy):
    """The database cannot be reached (restarting, failing over, its connections gone): 503
    with `Retry-After`, where an unexpected failure would be a 500 and a logged traceback."""

    code = "database_unavailable"


UNREACHABLE_SQLSTATES = ("57P01", "57P02", "57P03")
"""PostgreSQL's admin shutdown, crash shutdown and cannot-connect-now (starting up or
shutting down), besides class 08 (connection exceptions)."""


def database_unreachable(exc: OperationalError) -> bool:
    """True when `exc` says the database could not be reached or dropped the connection (a
    restart, a failover, a network cut; SQLite's lock held by another writer): worth a
    retry in a few seconds. False for an error the same request would meet again."""
    if exc.connection_invalidated:
        return True
    state = getattr(exc.orig, "sqlstate", None)
    message = str(exc.orig).lower()
    if type(exc.orig).__module__.startswith("psycopg"):
        if state is None:  # no SQLSTATE: the client's own error; the connection's, or not
            return "connection" in message or "server closed" in message
        return state.startswith("08") or state in UNREACHABLE_SQLSTATES
    return "database is locked" in message or "database is busy" in message


def error_body(code: str, message: str, field: str | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"code": code, "message": message}
    if field:
        body["field"] = field
    body.update(extra)
    return {"error": body}


# pydantic's wording of an unknown field hides that the field's *name* is the fault.
_MESSAGES = {"extra_forbidden": "unknown field (this request has no such field)"}


def _message_of(error: Any) -> str:
    # A validator's ValueError reads "Value error, <its message>": the message is the point.
    return _MESSAGES.get(error["type"], error["msg"].removeprefix("Value error, "))


def _field_of(loc: tuple[Any, ...]) -> str:
    # The first part says where the input came from; later parts are the user's names.
    if loc and loc[0] in ("body", "query", "path", "header", "cookie"):
        loc = loc[1:]
    return ".".join(str(p) for p in loc)


def install_error_handlers(app: FastAPI) -> None:
    """Map service, HTTP and validation errors onto the shared JSON shape."""

    @app.exception_handler(ServiceError)
    async def _service(_: Request, exc: ServiceError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.code, exc.message, exc.field),
            status_code=exc.status,
            headers=exc.headers,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body("http_error", str(exc.detail)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(OverflowError)
    @app.exception_handler(DataError)
    async def _out_of_range(_: Request, exc: Exception) -> JSONResponse:
        # An id or number beyond what the database stores names nothing that exists.
        return JSONResponse(
            error_body("invalid", "a number in the request is out of range"), status_code=422
        )

    @app.exception_handler(OperationalError)
    async def _database_down(request: Request, exc: Exception) -> Response:
        # One line in the log, not a traceback a request: while PostgreSQL restarts every
        # request fails alike. Answered as a ServiceError is (an HTML page for the portal).
        # Any other OperationalError (a missing table, a full disk, a statement timeout)
        # is a fault to fix, not to retry: a 500 with its traceback, as before.
        assert isinstance(exc, OperationalError)
        if not database_unreachable(exc):
            log.error("database error", exc_info=exc)
            return await request.app.exception_handlers[Exception](request, exc)  # type: ignore[no-any-return]
        log.warning("database unavailable: %s", str(exc).splitlines()[0][:300])
        refused = DatabaseUnavailable(
            "the database is unavailable (restarting?); try again in a few seconds",
            retry_after_s=5,
        )
        return await request.app.exception_handlers[ServiceError](request, refused)  # type: ignore[no-any-return]

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Starlette still logs the traceback; the caller gets the shared shape, no details.
        return JSONResponse(
            error_body("internal", "internal error; it has been logged"), status_code=500
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"field": _field_of(tuple(e["loc"])), "message": _message_of(e)} for e in exc.errors()
        ]
        first = errors[0] if errors else {"field": "", "message": "invalid request"}
        message = f"{first['field']}: {first['message']}" if first["field"] else first["message"]
        return JSONResponse(
            error_body("invalid", message, first["field"] or None, errors=errors), status_code=422
        )


class ErrorDetail(BaseModel):
    code: str = Field(examples=["invalid"], description="machine-readable kind of error")
    message: str = Field(examples=["resource group 'gpu-x' does not exist"])
    field: str | None = Field(
        default=None,
        examples=["resource_groups.1.name"],
        description="the faulty input, dotted (absent if none)",
    )
    errors: list[dict[str, Any]] | None = Field(
        default=None, description="every invalid field (request validation only)"
    )


class ErrorResponse(BaseModel):
    """The one shape of every error answer of the API."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "error": {
                        "code": "invalid",
                        "message": "resource group 'gpu-x' does not exist",
                        "field": "resource_groups.1.name",
                    }
                }
            ]
        }
    )

    error: ErrorDetail


def _described(text: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": text}


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: _described("not logged in, or an invalid, expired or revoked API token"),
    403: _described("logged in, but not allowed (e.g. not an admin)"),
    404: _described("no such resource, or not one the caller may see"),
    409: _described("conflicts with the current state (e.g. the task has already ended)"),
    422: _described("invalid input; `field` names it"),
}
