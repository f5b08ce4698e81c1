"""The web portal: server-rendered pages over the same services as the REST API.

Routes are sync `def` (FastAPI runs them in its threadpool) and only call
service functions, through `views` modules for what a page shows and `forms`
modules for what a form submits. A refused form is shown again with its HTTP
status, the entered values kept and each message next to its field. Every page
needs a logged-in session (else a redirect to /login); every form that changes
something carries the session's CSRF token.
"""

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend.auth.dependencies import LoginRequired
from backend.core.errors import ServiceError
from backend.core.http import security_headers
from backend.web import (
    account_pages,
    audit_pages,
    cluster_pages,
    code_pages,
    project_pages,
    sweep_pages,
    task_pages,
)
from backend.web.templating import redirect, render

API_PREFIXES = ("/api/", "/internal/", "/metrics", "/static/", "/docs", "/redoc", "/openapi")


def is_page(request: Request) -> bool:
    """Whether the request is for a portal page (answered in HTML) rather than the API."""
    return not request.url.path.startswith(API_PREFIXES)


def install_web(app: FastAPI) -> None:
    """Add the portal's routes, its login redirect and HTML error pages to `app`."""
    pages = (
        account_pages,
        task_pages,
        project_pages,
        code_pages,
        sweep_pages,
        cluster_pages,
        audit_pages,
    )
    for module in pages:
        app.include_router(module.router)
    json_errors = app.exception_handlers[ServiceError]

    async def service_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ServiceError)
        if not is_page(request):
            return await json_errors(request, exc)  # type: ignore[misc]
        titles = {401: "Log in", 403: "Not allowed", 404: "Not found", 409: "Conflict"}
        context = {"title": titles.get(exc.status, "Refused"), "message": exc.message}
        page = render(request, "error.html", context, status_code=exc.status)
        page.headers.update(exc.headers or {})  # Retry-After of a 503, as the API's answer
        return page

    async def login_required(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, LoginRequired)
        return redirect(f"/login?{account_pages.next_query(exc.next_url)}")

    app.add_exception_handler(ServiceError, service_error)
    app.add_exception_handler(LoginRequired, login_required)
    install_html_errors(app)


HTTP_TITLES = {404: "Not found", 405: "Not allowed", 413: "Too large"}


def install_html_errors(app: FastAPI) -> None:
    """Unknown pages (404 and other HTTP errors) and unexpected failures (500) of portal
    routes answer with the HTML error page; the API keeps the JSON error shape."""
    json_http = app.exception_handlers[StarletteHTTPException]
    json_unexpected = app.exception_handlers[Exception]

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if not is_page(request):
            return await json_http(request, exc)  # type: ignore[misc]
        context = {
            "title": HTTP_TITLES.get(exc.status_code, "Refused"),
            "message": "there is no such page" if exc.status_code == 404 else str(exc.detail),
        }
        return render(request, "error.html", context, status_code=exc.status_code)

    async def unexpected(request: Request, exc: Exception) -> Response:
        if not is_page(request):
            return await json_unexpected(request, exc)  # type: ignore[misc]
        context = {
            "title": "Something went wrong",
            "message": "an internal error occurred; it has been logged",
        }
        page = render(request, "error.html", context, status_code=500)
        # A 500 leaves by Starlette's outermost middleware, past SecurityHeadersMiddleware.
        page.headers.update(security_headers("text/html"))
        return page

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
