"""One audit event per write request, recorded by an ASGI middleware so no route can forget.

Recorded: every request to the REST API or the portal with a method other than GET, HEAD
or OPTIONS, whatever its answer (refusals included: 401, 403, 404, 409, 413, 422, 429, and
the portal's redirects to the login page or back with an error message); and every read
that is refused (401 not logged in, 403 not allowed, 404 not visible or no such object,
429 rate limited). Other reads are not (a 422 read is a malformed query, not a refusal).
The agents' `/internal/v1` calls (logs, metrics, heartbeats: telemetry at a high rate from
trusted services, not user actions) and static files are left out.

The authentication dependencies put the caller on `request.state` (`user`,
`api_token_id`) as soon as they know it, so a request refused after authentication
still names its actor. The event is written in its own short transaction just before the
answer's last byte is sent: a client that got its answer finds the event already listed.
If the write fails, the event is logged at ERROR level with every field and the answer
is sent unchanged: the request's own change is committed by then, so failing the answer
would only tell the client something false.
"""

import logging
import re
import uuid
from dataclasses import dataclass, field

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backend.audit import actions, service
from backend.audit.models import AuditOutcome
from backend.audit.schemas import AuditEventCreate
from backend.core.db import get_sessionmaker
from backend.web.templating import FLASH_COOKIE

log = logging.getLogger(__name__)

READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# A read's refusals: not logged in, not allowed, not visible (or no such object), rate limited.
READ_REFUSALS = frozenset({401, 403, 404, 429})
NOT_AUDITED = ("/internal/", "/static/")
REQUEST_ID_HEADER = "X-Request-ID"
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_BODY_BYTES = 64 * 1024  # a created object's id is read from answers up to this size
LOGIN_PAGE = "/login?"
ERROR_FLASH = f"{FLASH_COOKIE}=error"  # set by backend.web.templating.redirect(kind="error")
LOGIN_ACTIONS = ("auth.login", "auth.logout")


def is_audited(path: str) -> bool:
    """Whether requests to `path` may be recorded (the REST API and the portal)."""
    return not path.startswith(NOT_AUDITED)


def is_recorded(method: str, status: int) -> bool:
    """Whether a request to an audited path is recorded: every write, and refused reads."""
    return method not in READ_METHODS or status in READ_REFUSALS


def request_id(headers: Headers) -> str:
    """The caller's `X-Request-ID` if it is a plain token of up to 64 characters, else new."""
    sent = headers.get(REQUEST_ID_HEADER, "")
    return sent if _CLIENT_REQUEST_ID.fullmatch(sent) else uuid.uuid4().hex


@dataclass
class Answer:
    """What the app answered, as seen passing through (status 500 until it starts)."""

    status: int = 500
    headers: Headers = field(default_factory=Headers)
    body: bytearray | None = None
    recorded: bool = False

    def start(self, message: Message, *, keep_json: bool) -> None:
        """The answer's status and headers; keep its JSON body if `keep_json` (a write's)."""
        self.status = int(message["status"])
        self.headers = Headers(raw=message.get("headers", []))
        if keep_json and self.headers.get("content-type", "").startswith("application/json"):
            self.body = bytearray()

    def add(self, chunk: bytes) -> None:
        """Keep a JSON answer's bytes while it stays under MAX_BODY_BYTES."""
        if self.body is not None and len(self.body) + len(chunk) > MAX_BODY_BYTES:
            self.body = None
        elif self.body is not None:
            self.body += chunk

    def outcome(self, action: str) -> AuditOutcome:
        """Done, refused or failed, for the portal too (which refuses with a redirect)."""
        if self.status >= 500:
            return AuditOutcome.FAILED
        if self.status >= 400:
            return AuditOutcome.REFUSED
        to_login = self.headers.get("location", "").startswith(LOGIN_PAGE)
        error_flash = any(c.startswith(ERROR_FLASH) for c in self.headers.getlist("set-cookie"))
        if (to_login and action not in LOGIN_ACTIONS) or error_flash:
            return AuditOutcome.REFUSED
        return AuditOutcome.OK


def _route_template(scope: Scope) -> str | None:
    """The path template of the route that served the request (None: no route took it)."""
    route = scope.get("route")
    methods = getattr(route, "methods", None) or set()
    return getattr(route, "path", None) if scope["method"] in methods else None


def _actor(scope: Scope, answer: Answer, action: str) -> tuple[int | None, int | None]:
    """(user id, API token id) of the caller, as the authentication dependency left them."""
    state = scope.get("state") or {}
    user_id = getattr(state.get("user"), "id", None)
    if user_id is None and action == "auth.login" and answer.body and answer.status < 400:
        # A REST login authenticates by password inside the route; its answer names the user.
        described = actions.answer_field(bytes(answer.body), "user", "id")
        user_id = int(described) if described and described.isdigit() else None
    return user_id, state.get("api_token_id")


def _text(value: object, limit: int) -> str:
    """`value` as text that every database stores: NUL replaced (PostgreSQL refuses it, and
    a request must not escape the log by naming a path with %00), cut to `limit` chars."""
    return str(value).replace("\x00", "\ufffd")[:limit]


def event_for(scope: Scope, answer: Answer, rid: str) -> AuditEventCreate:
    """The audit event of one finished request."""
    state = scope.get("state") or {}
    described = actions.describe(
        scope["method"],
        _route_template(scope),
        scope.get("path_params") or {},
        actor=getattr(state.get("user"), "id", None),
        body=bytes(answer.body) if answer.body else None,
        location=answer.headers.get("location"),
    )
    user_id, token_id = _actor(scope, answer, described.action)
    client = scope.get("client")
    object_id = described.object_id
    return AuditEventCreate(
        actor_user_id=user_id,
        actor_token_id=token_id,
        action=described.action,
        object_type=described.object_type,
        object_id=_text(object_id, 100) if object_id is not None else None,
        method=_text(scope["method"], 8),
        path=_text(scope["path"], 500),
        status_code=answer.status,
        outcome=answer.outcome(described.action),
        client_address=_text(client[0], 64) if client else None,
        request_id=rid,
    )


def write(event: AuditEventCreate) -> None:
    """Store one event in its own transaction; a failure is logged, never raised."""
    try:
        with get_sessionmaker()() as session:
            service.record(session, data=event)
    except Exception:
        log.exception("AUDIT EVENT NOT RECORDED: %s", event.model_dump_json())


class AuditMiddleware:
    """ASGI middleware recording every write request (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_audited(scope["path"]):
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})
        method = scope["method"]
        rid = request_id(Headers(scope=scope))
        answer = Answer()

        async def record() -> None:
            answer.recorded = True
            try:
                event = event_for(scope, answer, rid)
            except Exception:
                log.exception("AUDIT EVENT NOT RECORDED: %s %s", method, scope["path"])
                return
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(write, event)

        async def send_and_record(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer.start(message, keep_json=method not in READ_METHODS)
                if is_recorded(method, answer.status):
                    MutableHeaders(scope=message).append(REQUEST_ID_HEADER, rid)
            elif message["type"] == "http.response.body":
                answer.add(message.get("body", b""))
                if (
                    not message.get("more_body", False)
                    and not answer.recorded
                    and is_recorded(method, answer.status)
                ):
                    await record()
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            if not answer.recorded and is_recorded(method, answer.status):
                await record()
