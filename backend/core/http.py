"""Pure ASGI middlewares of the API service: a request body limit enforced before anything
reads the body, and the security headers of every answer (a CSP on portal pages).

Both are pure ASGI (not `BaseHTTPMiddleware`) so that they wrap the raw `receive`/`send`
channels: a declared oversized body is refused without one byte of it read, a streamed
one as soon as the bytes received pass the limit.
"""

import json
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The portal's own scripts and styles only (no inline script, style or event handler).
PORTAL_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
# Swagger UI and ReDoc load their bundles from a CDN: no CSP there, but never framed.
DOC_PATHS = ("/docs", "/redoc")


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a streamed body passes the limit; an HTTPException so that
    FastAPI's body parsing passes it on as a 413 instead of a 400."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes")


def _error(status: int, message: str) -> bytes:
    code = "too_large" if status == 413 else "invalid"
    return json.dumps({"error": {"code": code, "message": message}}).encode()


async def _answer(send: Send, status: int, message: str) -> None:
    body = _error(status, message)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """Refuse request bodies larger than `limit_for(scope)` bytes with 413.

    A `Content-Length` over the limit is answered at once, before authentication and
    without reading the body; a body without one (chunked) is counted as it streams in
    and refused as soon as it passes the limit, so at most `limit` bytes are held.
    """

    def __init__(self, app: ASGIApp, *, limit_for: Callable[[Scope], int]) -> None:
        self.app, self.limit_for = app, limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await _answer(send, 400, "Content-Length is not a number")
                return
            if int(declared) > limit:
                await _answer(send, 413, f"the request body is larger than {limit} bytes")
                return
        received, started = 0, False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge as exc:
            if started:
                raise
            await _answer(send, 413, str(exc.detail))


def security_headers(content_type: str, *, docs: bool = False) -> dict[str, str]:
    """The security headers of an answer of this content type (lower-case names); HTML
    other than the API docs gets the portal's CSP and `no-store`."""
    headers = {
        "x-content-type-options": "nosniff",
        "referrer-policy": "same-origin",
        "x-frame-options": "DENY",
    }
    if content_type.startswith("text/html") and not docs:
        headers |= {"content-security-policy": PORTAL_CSP, "cache-control": "no-store"}
    return headers


class SecurityHeadersMiddleware:
    """Add nosniff, Referrer-Policy and X-Frame-Options to every answer; HTML pages of the
    portal also get a Content-Security-Policy and `Cache-Control: no-store` (they show
    per-user data and CSRF tokens, which no shared cache may keep)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        docs = scope["path"].startswith(DOC_PATHS)

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                content_type = dict(headers).get(b"content-type", b"").decode("latin-1")
                names = {name.lower() for name, _ in headers}
                headers += [
                    (k.encode(), v.encode())
                    for k, v in security_headers(content_type, docs=docs).items()
                    if k.encode() not in names
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)
