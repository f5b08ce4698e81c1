"""The polytrain API service: REST under /api/v1, the internal agent API, the web portal."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.staticfiles import StaticFiles

from backend.agents.router import router as agents_router
from backend.core.config import get_settings
from backend.core.errors import install_error_handlers
from backend.internal.router import router as internal_router
from backend.projects.router import router as projects_router
from backend.resource_groups.router import router as groups_router
from backend.scheduler.loop import SchedulerLoop
from backend.tasks.router import router as tasks_router

STATIC_DIR = Path(__file__).resolve().parents[1] / "frontend" / "static"


def api_router() -> APIRouter:
    router = APIRouter(prefix="/api/v1")
    for sub in (projects_router, tasks_router, groups_router, agents_router):
        router.include_router(sub)
    router.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"], tags=["health"])
    return router


def create_app(*, run_scheduler: bool = True) -> FastAPI:
    """Build the ASGI app; the scheduler thread runs inside it unless told not to."""
    settings = get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = SchedulerLoop(settings) if run_scheduler else None
        if loop:
            loop.start()
        app.state.scheduler = loop
        yield
        if loop:
            loop.stop()

    app = FastAPI(title="polytrain", version="0.1.0", lifespan=lifespan,
                  description="Train one PyTorch model across resource groups of mixed hardware.")
    install_error_handlers(app)
    app.include_router(api_router())
    app.include_router(internal_router)
    from backend.web.router import router as web_router

    app.include_router(web_router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
