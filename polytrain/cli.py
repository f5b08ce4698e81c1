"""The `polytrain` command: run the API, an agent, migrations; and, as a client of the API,
log in, list projects, submit tasks, follow their status and logs, cancel them."""

import os
from typing import TYPE_CHECKING, Annotated

import typer

from polytrain.client.commands import register as register_client_commands

if TYPE_CHECKING:
    from backend.core.config import Settings

app = typer.Typer(
    help="polytrain: one PyTorch training task across mixed hardware.", no_args_is_help=True
)
db_app = typer.Typer(help="Database migrations (Alembic).", no_args_is_help=True)
app.add_typer(db_app, name="db")
groups_app = typer.Typer(help="Resource groups (admin).", no_args_is_help=True)
app.add_typer(groups_app, name="groups")
users_app = typer.Typer(
    help="Accounts, on the API's own host (database access).", no_args_is_help=True
)
app.add_typer(users_app, name="users")


SHUTDOWN_GRACE_S = 10  # seconds a stopping API process waits for open requests and streams


@app.command()
def api(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
    workers: Annotated[
        int,
        typer.Option(
            envvar="WEB_CONCURRENCY",
            help="API processes on the one port, at least 1; one of them, elected, runs the "
            "scheduler (more than 1 needs PostgreSQL and a shared rate-limit store)",
        ),
    ] = 1,
) -> None:
    """Serve the REST API, the portal and the scheduler (run `polytrain db upgrade` first).

    With `--workers N` (or WEB_CONCURRENCY) N processes accept on one socket (uvicorn's
    supervisor restarts one that dies); exactly one of them, elected by a PostgreSQL
    advisory lock, runs the scheduler and the liveness monitor, and another takes over
    within two `POLYTRAIN_SCHEDULER_LEASE_S` periods when it dies (several `polytrain api`
    on one database, e.g. on several hosts, share the election the same way). Exits with
    status 2 naming the setting when N > 1 is unsafe or another API process already
    serves the embedded SQLite database, 3 when the database or the rate-limit store it
    needs cannot be reached (checked before the processes start, which the supervisor
    would otherwise restart without end).
    """
    import uvicorn

    from backend.core.config import get_settings
    from backend.scheduler.leader import SqliteInUse, hold_sqlite

    if workers < 1:
        typer.echo(
            f"error: --workers {workers} (or WEB_CONCURRENCY={workers}) starts no API process: "
            "at least 1 must serve requests and run the scheduler",
            err=True,
        )
        raise typer.Exit(2)
    url = get_settings().resolved_database_url()
    if workers == 1 and url.startswith("sqlite"):
        try:
            hold_sqlite(url)  # held until this process exits
        except SqliteInUse as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
    if workers > 1:
        settings = get_settings()
        problem = multi_process_problem(settings, workers)
        if problem:
            typer.echo(f"error: {problem}", err=True)
            raise typer.Exit(2)
        problem = unreachable(settings)
        if problem:
            typer.echo(f"error: {problem}", err=True)
            raise typer.Exit(3)
    # Forwarded headers are trusted by the app itself (POLYTRAIN_FORWARDED_ALLOW_IPS), not by
    # uvicorn's default of trusting 127.0.0.1. Each process stops its scheduler at the first
    # exit signal (backend.scheduler.loop.stop_at_exit_signal).
    config = uvicorn.Config(
        "backend.main:create_app",
        factory=True,
        host=host,
        port=port,
        log_level="warning",
        proxy_headers=False,
        workers=workers,
        # An open log stream would otherwise hold a stopping process without limit.
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    if workers == 1:
        uvicorn.Server(config).run()
        return
    from uvicorn.supervisors import Multiprocess

    Multiprocess(config, sockets=[config.bind_socket()]).run()


def multi_process_problem(settings: "Settings", workers: int) -> str | None:
    """Why `workers` API processes would be unsafe with `settings`, or None.

    SQLite has one writer and the embedded default one scheduler; login counters in each
    process's memory would allow `workers` times the configured rates.
    """
    asked = f"--workers {workers} (or WEB_CONCURRENCY={workers})"
    if settings.resolved_database_url().startswith("sqlite"):
        return f"{asked} needs PostgreSQL (set DATABASE_URL): on SQLite the API runs as one process"
    storage = settings.rate_limit_storage_url or ""
    if not storage or storage.startswith("memory:"):
        return (
            f"{asked} needs POLYTRAIN_RATE_LIMIT_STORAGE_URL set to a shared store (e.g. "
            "redis://host:6379/1): with login counters in each process's memory the "
            f"login rate limits would allow {workers} times their rates"
        )
    return None


def unreachable(settings: "Settings") -> str | None:
    """What of the database and the rate-limit store cannot be reached, or None."""
    from limits.storage import storage_from_string
    from sqlalchemy import text

    from backend.core.db import make_engine

    engine = make_engine(settings.resolved_database_url())
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001 - any driver error: the message names it
        return f"the database (DATABASE_URL) cannot be reached: {exc}"
    finally:
        engine.dispose()
    url = settings.rate_limit_storage_url or ""
    try:
        reachable = storage_from_string(url).check()
    except Exception as exc:  # noqa: BLE001 - a malformed URL or a missing driver
        return f"POLYTRAIN_RATE_LIMIT_STORAGE_URL {url!r} is not usable: {exc}"
    if not reachable:
        return f"the rate-limit store POLYTRAIN_RATE_LIMIT_STORAGE_URL {url!r} cannot be reached"
    return None


@app.command()
def agent(
    resource_group: Annotated[str, typer.Option(help="the resource group this agent serves")],
    workers: Annotated[int, typer.Option(min=1, help="worker processes this host runs")] = 1,
    name: Annotated[str | None, typer.Option(help="agent name (default host-group-pid)")] = None,
) -> None:
    """Serve one resource group's queue on this host.

    Exits with status 2 and the reason when the backend refuses the agent,
    e.g. a live agent elsewhere already uses NAME (two agents cannot share one).
    """
    import httpx

    from worker.agent.client import Conflict
    from worker.agent.hardware import NoDevice
    from worker.agent.identity import NameClash
    from worker.agent.main import run_agent
    from worker.agent.uids import SandboxUnavailable
    from worker.config import AgentSettings

    try:
        run_agent(
            AgentSettings(),  # type: ignore[call-arg]
            resource_group=resource_group,
            workers=workers,
            name=name,
        )
    except (Conflict, NameClash) as exc:
        typer.echo(f"agent refused: {exc}", err=True)
        raise typer.Exit(2) from exc
    except SandboxUnavailable as exc:
        typer.echo(f"agent cannot sandbox training code: {exc}", err=True)
        raise typer.Exit(2) from exc
    except NoDevice as exc:
        typer.echo(f"agent cannot serve group '{resource_group}': {exc}", err=True)
        raise typer.Exit(2) from exc
    except httpx.HTTPStatusError as exc:
        message = exc.response.json().get("error", {}).get("message", exc.response.text)
        typer.echo(f"agent refused: {message}", err=True)
        raise typer.Exit(2) from exc


@db_app.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Apply migrations up to `revision`."""
    from backend.core.migrate import upgrade

    upgrade(revision=revision)


@db_app.command("downgrade")
def db_downgrade(revision: str = "base") -> None:
    """Revert migrations down to `revision`."""
    from backend.core.migrate import downgrade

    downgrade(revision=revision)


@app.command()
def demo(
    port: Annotated[int, typer.Option(envvar="POLYTRAIN_PORT")] = 8000,
    epochs: Annotated[int, typer.Option(min=1)] = 6,
    global_batch_size: Annotated[int, typer.Option(min=3)] = 64,
    timeout_s: Annotated[float, typer.Option(help="give up after this many seconds")] = 600,
) -> None:
    """Train the bundled MNIST example across two CPU groups; print one JSON line."""
    from polytrain.demo import run_demo

    raise typer.Exit(
        run_demo(port=port, epochs=epochs, global_batch_size=global_batch_size, timeout_s=timeout_s)
    )


@app.command()
def up(
    port: Annotated[int, typer.Option(envvar="POLYTRAIN_PORT")] = 8000,
    data_dir: Annotated[str, typer.Option(help="database, logs, admin password")] = "var/up",
) -> None:
    """Start the portal (API, scheduler, two agents) on loopback and keep it running.

    A child that dies is restarted with backoff; SIGTERM/SIGINT/SIGHUP to this
    process or its process group stops every child.
    """
    from pathlib import Path

    from polytrain.demo import run_up

    run_up(port=port, data_dir=Path(data_dir))


@users_app.command("create-admin")
def create_admin(
    email: str,
    password: Annotated[
        str | None,
        typer.Option(envvar="POLYTRAIN_ADMIN_PASSWORD", help="default: asked for (not echoed)"),
    ] = None,
) -> None:
    """Create the admin EMAIL (or make that account an admin) in the database."""
    from backend.auth.service import ensure_admin
    from backend.core.db import get_sessionmaker

    password = password or typer.prompt("Password", hide_input=True, confirmation_prompt=True)
    if len(password) < 8:
        typer.echo("the password needs at least 8 characters", err=True)
        raise typer.Exit(2)
    with get_sessionmaker()() as session:
        user, created = ensure_admin(session, email=email, password=password)
    typer.echo(f"admin {user.email}: {'created' if created else 'exists (made admin)'}")


def _admin_headers(api_url: str, token: str | None) -> dict[str, str]:
    """A token from --token / POLYTRAIN_TOKEN / `polytrain login`, else a login with
    POLYTRAIN_ADMIN_EMAIL and POLYTRAIN_ADMIN_PASSWORD (as docker-compose's init job does)."""
    from polytrain.client.api import Api

    token = Api.resolve(url=api_url, token=token).token
    email, password = (
        os.environ.get("POLYTRAIN_ADMIN_EMAIL"),
        os.environ.get("POLYTRAIN_ADMIN_PASSWORD"),
    )
    if not token and email and password:
        token = Api(api_url, None).post(
            "/auth/login",
            json={
                "email": email,
                "password": password,
                "token_name": "groups ensure",
                "expires_in_days": 1,
            },
        )["token"]
    return {"Authorization": f"Bearer {token}"} if token else {}


@groups_app.command("ensure")
def groups_ensure(
    name: str,
    device_type: Annotated[str, typer.Option(help="cpu, cuda or npu")] = "cpu",
    capacity: Annotated[int, typer.Option(min=1, help="most workers at once")] = 1,
    api_url: Annotated[str, typer.Option(envvar="POLYTRAIN_API_URL")] = "http://127.0.0.1:8000",
    token: Annotated[str | None, typer.Option(help="an admin's API token")] = None,
) -> None:
    """Create resource group NAME through the REST API unless it exists (as an admin)."""
    import httpx

    from polytrain.client.api import ClientError

    try:
        headers = _admin_headers(api_url, token)
    except ClientError as exc:
        typer.echo(f"refused: {exc}", err=True)
        raise typer.Exit(2) from exc
    response = httpx.post(
        f"{api_url}/api/v1/resource-groups",
        timeout=30,
        headers=headers,
        json={"name": name, "device_type": device_type, "capacity": capacity},
    )
    if response.status_code not in (201, 409):
        typer.echo(f"refused: {response.json()['error']['message']}", err=True)
        raise typer.Exit(2)
    typer.echo(f"resource group {name}: {'created' if response.status_code == 201 else 'exists'}")


register_client_commands(app)

if __name__ == "__main__":
    app()
