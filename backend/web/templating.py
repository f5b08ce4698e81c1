"""Jinja2 environment of the portal: template directory, filters and the render helper."""

from datetime import datetime
from typing import Any
from urllib.parse import quote, unquote

from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.templating import Jinja2Templates

from backend.core.paths import asset
from contracts.packages import pins

TEMPLATE_DIR = asset("frontend/templates")
FLASH_COOKIE = "polytrain_flash"

templates = Jinja2Templates(directory=TEMPLATE_DIR)


def format_time(value: datetime | None) -> str:
    """A naive UTC timestamp as `YYYY-MM-DD HH:MM:SS`, or an em dash when missing."""
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "—"


def format_bytes(size: int | float | None) -> str:
    """A byte count in the largest unit that keeps it at least 1 (B, KiB, MiB, GiB)."""
    value = float(size or 0)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def percent(fraction: float | None) -> str:
    """A 0..1 fraction as a whole percentage, e.g. `42%`."""
    return f"{(fraction or 0.0) * 100:.0f}%"


def format_duration(seconds: float | None) -> str:
    """Seconds as `45 s`, `12 min 5 s` or `3 h 20 min`; an em dash when unknown."""
    if seconds is None:
        return "—"
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def lock_pins(lock: str | None) -> list[str]:
    """A code version's lock as its packages, `name==version` each (none without a lock)."""
    return [f"{name}=={version}" for name, version in pins(lock or "").items()]


templates.env.filters.update(
    time=format_time,
    bytes=format_bytes,
    percent=percent,
    duration=format_duration,
    pins=lock_pins,
)


def render(
    request: Request, name: str, context: dict[str, Any], *, status_code: int = 200
) -> HTMLResponse:
    """Render `name` with `context`; shows and clears a pending flash message.

    Every page also gets the logged-in `user` and the session's `csrf_token`,
    which each form that changes something sends back.
    """
    flash = read_flash(request)
    base = {
        "flash": flash,
        "user": getattr(request.state, "user", None),
        "csrf_token": getattr(request.state, "csrf_token", ""),
        "docs_enabled": request.app.docs_url is not None,
    }
    response = templates.TemplateResponse(
        request, name, {**base, **context}, status_code=status_code
    )
    if flash:
        response.delete_cookie(FLASH_COOKIE, path="/")
    return response


def fragment(request: Request, name: str, context: dict[str, Any]) -> HTMLResponse:
    """Render the partial template `name` (a section a page fetches again): no layout, and
    a pending flash is left for the next page."""
    return templates.TemplateResponse(request, name, context)


def redirect(url: str, *, flash: str | None = None, kind: str = "info") -> RedirectResponse:
    """A 303 redirect (POST → GET), carrying an optional one-shot flash message."""
    response = RedirectResponse(url, status_code=303)
    if flash:
        response.set_cookie(
            FLASH_COOKIE,
            quote(f"{kind}:{flash}"),
            path="/",
            httponly=True,
            samesite="lax",
            max_age=60,
        )
    return response


def read_flash(request: Request) -> dict[str, str] | None:
    """The pending flash message as `{"kind", "message"}`, if the last redirect left one."""
    raw = request.cookies.get(FLASH_COOKIE)
    if not raw:
        return None
    kind, _, message = unquote(raw).partition(":")
    if kind not in ("info", "error") or not message:
        return None
    return {"kind": kind, "message": message}
