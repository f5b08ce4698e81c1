"""The polytrain API service: REST under /api/v1, the internal agent API, the web portal,
Prometheus metrics at /metrics."""

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials
from fastapi.staticfiles import StaticFiles
from starlette.types import Scope
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from backend.agent_api.router import router as agent_api_router
from backend.agent_api.waits import StateWaits, close_at_exit_signal
from backend.agents.router import router as agents_router
from backend.agents.stamps import HeldStamps, StampFlusher
from backend.audit.middleware import AuditMiddleware
from backend.audit.router import router as audit_router
from backend.auth import service as users
from backend.auth.dependencies import bearer_scheme
from backend.auth.router import auth_router, users_router
from backend.auth.security import same
from backend.auth.throttle import HashGate, LoginLimiter
from backend.core.config import Settings, get_settings
from backend.core.db import get_sessionmaker
from backend.core.dependencies import SettingsDep
from backend.core.errors import ERROR_RESPONSES, Unauthorized, install_error_handlers
from backend.core.http import BodyLimitMiddleware, SecurityHeadersMiddleware
from backend.core.paths import asset
from backend.core.schemas import refuse_nul_inputs
from backend.plans.router import router as plans_router
from backend.projects.router import router as projects_router
from backend.prometheus import CONTENT_TYPE, render_metrics
from backend.resource_groups.router import router as groups_router
from backend.scheduler.loop import SchedulerLoop, stop_at_exit_signal
from backend.sweeps.router import router as sweeps_router
from backend.tasks.router import router as tasks_router

STATIC_DIR = asset("frontend/static")
log = logging.getLogger(__name__)


def api_router() -> APIRouter:
    """Every public REST route under /api/v1, each documented with the shared error shape."""
    router = APIRouter(prefix="/api/v1", responses=ERROR_RESPONSES)
    for sub in (
        auth_router,
        users_router,
        projects_router,
        tasks_router,
        sweeps_router,
        plans_router,
        groups_router,
        agents_router,
        audit_router,
    ):
        router.include_router(sub)
    router.add_api_route(
        "/health",
        lambda: {"status": "ok"},
        methods=["GET"],
        tags=["health"],
        summary="Liveness (no login needed)",
    )
    return router


def metrics_endpoint(
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> Response:
    """Prometheus metrics; asks for `Authorization: Bearer <metrics token>` when one is set."""
    expected = settings.metrics_token
    if expected is not None and not same(
        credentials.credentials if credentials else "", expected.get_secret_value()
    ):
        raise Unauthorized("send 'Authorization: Bearer <POLYTRAIN_METRICS_TOKEN>'")
    return Response(render_metrics(), media_type=CONTENT_TYPE)


def bootstrap_admin(settings: Settings) -> None:
    """Create the first admin from POLYTRAIN_ADMIN_EMAIL / POLYTRAIN_ADMIN_PASSWORD if set."""
    if not (settings.admin_email and settings.admin_password):
        return
    with get_sessionmaker()() as session:
        user, created = users.ensure_admin(
            session, email=settings.admin_email, password=settings.admin_password.get_secret_value()
        )
    if created:
        log.warning("created the first admin %s from the settings", user.email)


def body_limit(settings: Settings) -> Callable[[Scope], int]:
    """The largest request body (bytes) of a request: on /internal/v1 a request carrying the
    agent token gets `max_internal_body_bytes` (checkpoints); every other request, the
    internal API's unauthenticated ones included, `max_body_bytes`, at least a code upload
    and its form fields. The token is checked here because FastAPI reads a body before the
    route's authentication runs."""
    public = max(settings.max_body_bytes, settings.max_upload_bytes + 64 * 1024)
    agent = f"Bearer {settings.agent_token.get_secret_value()}".encode()

    def limit_for(scope: Scope) -> int:
        if scope["path"].startswith("/internal/"):
            authorization = dict(scope["headers"]).get(b"authorization", b"")
            if hmac.compare_digest(authorization, agent):
                return settings.max_internal_body_bytes
        return public

    return limit_for


def install_middleware(app: FastAPI, settings: Settings) -> None:
    """Body limit (innermost), security headers, then trusted proxy headers (outermost)."""
    app.add_middleware(BodyLimitMiddleware, limit_for=body_limit(settings))
    app.add_middleware(SecurityHeadersMiddleware)
    if settings.forwarded_allow_ips:
        trusted = [h.strip() for h in settings.forwarded_allow_ips.split(",") if h.strip()]
        app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=trusted)


def reset_state(app: FastAPI, settings: Settings) -> None:
    """Give `app` new process state: held heartbeat stamps, the agents' state long-polls and
    the login throttles the auth routes use (`create_app` starts with it; a test suite that
    serves several tests from one app calls it between them)."""
    app.state.stamps, app.state.state_waits = HeldStamps(), StateWaits()
    app.state.login_limiter = LoginLimiter(settings)
    app.state.hash_gate = HashGate(
        slots=settings.hash_concurrency, queue=settings.hash_queue, wait_s=settings.hash_wait_s
    )


def create_app(*, run_scheduler: bool = True) -> FastAPI:
    """Build the ASGI app; the scheduler thread runs inside it unless told not to."""
    settings = get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(bootstrap_admin, settings)
        # Heartbeat stamps written once a second; long-polls answered at the exit signal.
        flusher = StampFlusher(app.state.stamps, get_sessionmaker())
        flusher.start()
        close_at_exit_signal(app.state.state_waits, asyncio.get_running_loop())
        loop = SchedulerLoop(settings) if run_scheduler else None
        if loop:
            loop.start()
            stop_at_exit_signal()
        app.state.scheduler = loop
        yield
        app.state.state_waits.close()
        if loop:
            loop.stop()
        await run_in_threadpool(flusher.stop)

    docs = settings.docs_enabled
    app = FastAPI(
        title="polytrain",
        version="0.1.0",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
        dependencies=[Depends(refuse_nul_inputs)],
        description="Train one PyTorch model across resource groups of mixed hardware. "
        "Authenticate with a personal API token: `POST /api/v1/auth/login`, then "
        "`Authorization: Bearer <token>`. Lists take `offset` and `limit` and give "
        "the total in `X-Total-Count`. Every error has the shape "
        '`{"error": {"code", "message", "field"}}`.',
    )
    reset_state(app, settings)
    install_error_handlers(app)
    install_middleware(app, settings)
    app.include_router(api_router())
    app.include_router(agent_api_router, include_in_schema=False)  # agents only, not public
    app.add_api_route("/metrics", metrics_endpoint, methods=["GET"], include_in_schema=False)
    from backend.web.router import install_web

    install_web(app)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.add_middleware(AuditMiddleware)  # added last: outermost, so it sees every refusal
    return app
