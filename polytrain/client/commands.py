"""The client commands of `polytrain`: log in, projects, submit, status, logs, cancel."""

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from polytrain.client import spec as task_spec
from polytrain.client.api import Api, ClientError, forget_credentials, save_credentials

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
console = Console()
err = Console(stderr=True)
projects_app = typer.Typer(help="Your projects.", invoke_without_command=True)
ApiUrl = Annotated[
    str | None,
    typer.Option(
        "--api-url", envvar="POLYTRAIN_API_URL", help="the API (default: as saved by login)"
    ),
]


def _fail(exc: ClientError) -> typer.Exit:
    err.print(f"[red]error:[/red] {exc}")
    return typer.Exit(1)


def login(
    api_url: ApiUrl = None,
    email: Annotated[str | None, typer.Option(help="your account's email")] = None,
    token: Annotated[
        str | None,
        typer.Option(
            help="use this API token instead of a password (from the portal's Account page)"
        ),
    ] = None,
    expires_in_days: Annotated[int, typer.Option(min=1, max=3650)] = 90,
) -> None:
    """Log in: exchange email and password for an API token and keep it for later commands."""
    api = Api.resolve(url=api_url)
    try:
        if token:
            me = Api(api.url, token).get("/users/me")
        else:
            email = email or typer.prompt("Email")
            password = typer.prompt("Password", hide_input=True)
            created = Api(api.url, None).post(
                "/auth/login",
                json={
                    "email": email,
                    "password": password,
                    "token_name": "polytrain CLI",
                    "expires_in_days": expires_in_days,
                },
            )
            token, me = created["token"], created["user"]
    except ClientError as exc:
        raise _fail(exc) from exc
    path = save_credentials(api.url, token, me["email"])
    console.print(f"logged in to {api.url} as {me['email']} ({me['role']}); token in {path}")


def logout() -> None:
    """Revoke the saved token and forget it."""
    api = Api.resolve()
    if api.token:
        try:
            api.post("/auth/logout")
        except ClientError as exc:
            err.print(f"could not revoke the token: {exc}")
    forget_credentials()
    console.print("logged out")


@projects_app.callback()
def projects(
    ctx: typer.Context,
    api_url: ApiUrl = None,
    archived: Annotated[bool, typer.Option(help="list archived ones too")] = False,
) -> None:
    """List your projects (or run a sub-command)."""
    if ctx.invoked_subcommand:
        return
    try:
        rows = Api.resolve(url=api_url).get(
            "/projects", params={"limit": 500, "include_archived": archived}
        )
    except ClientError as exc:
        raise _fail(exc) from exc
    table = Table("id", "name", "description", "created (UTC)", "archived")
    for row in rows:
        table.add_row(
            str(row["id"]),
            row["name"],
            row["description"][:60],
            row["created_at"][:19],
            "yes" if row["archived_at"] else "",
        )
    console.print(table)


@projects_app.command("create")
def create_project(
    name: str, description: Annotated[str, typer.Option("-d")] = "", api_url: ApiUrl = None
) -> None:
    """Create a project."""
    try:
        row = Api.resolve(url=api_url).post(
            "/projects", json={"name": name, "description": description}
        )
    except ClientError as exc:
        raise _fail(exc) from exc
    console.print(f"project {row['id']}: {row['name']}")


def submit(
    spec_file: Annotated[
        Path, typer.Argument(help="the task's YAML spec", exists=True, dir_okay=False)
    ],
    follow: Annotated[bool, typer.Option(help="show a progress bar until it ends")] = False,
    api_url: ApiUrl = None,
) -> None:
    """Submit a task from a YAML spec (uploading its code if it names a file)."""
    api = Api.resolve(url=api_url)
    try:
        spec = task_spec.load(spec_file)
        project = task_spec.project_id(api, spec["project"])
        version = task_spec.code_version_id(api, project, spec, spec_file.parent)
        task = api.post("/tasks", json=task_spec.task_body(spec, project, version))
    except ClientError as exc:
        raise _fail(exc) from exc
    console.print(f"task {task['id']} submitted: {task['name']} ({task['status']})")
    if follow:
        raise typer.Exit(_watch(api, task["id"]))


def _eta(task: dict[str, Any]) -> str:
    """The API's estimate as "12 min 5 s (at 2026-11-26T09:03:00Z)", or "—" before it has one."""
    eta, finish = task.get("eta_s"), task.get("predicted_finish_at")
    if eta is None or finish is None:
        return "—"
    minutes, seconds = divmod(round(eta), 60)
    return f"{f'{minutes} min ' if minutes else ''}{seconds} s (at {finish})"


def _show(task: dict[str, Any]) -> None:
    table = Table(show_header=False, box=None)
    groups = task["spec"].get("groups") or task["spec"].get("request") or []
    for key, value in [
        ("task", f"{task['id']} {task['name']}"),
        ("status", task["status"]),
        ("reason", task["status_reason"]),
        ("progress", f"{task['progress'] * 100:.0f}% (epoch {task['epoch']})"),
        (
            "groups",
            ", ".join(f"{g.get('name') or g.get('device_type')}×{g['workers']}" for g in groups),
        ),
        ("created", task["created_at"]),
        ("started", task["started_at"] or "—"),
        ("finished", task["finished_at"] or "—"),
        ("time to finish", _eta(task)),
    ]:
        table.add_row(f"[bold]{key}", str(value))
    console.print(table)


def _watch(api: Api, task_id: int) -> int:
    """A progress bar until the task ends; exit code 0 if it succeeded."""
    columns = (
        TextColumn("[bold]{task.fields[status]:<10}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%  epoch {task.fields[epoch]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as bar:
        row = bar.add_task(f"task {task_id}", total=1.0, status="", epoch=0)
        while True:
            task = api.get(f"/tasks/{task_id}")
            bar.update(row, completed=task["progress"], status=task["status"], epoch=task["epoch"])
            if task["status"] in TERMINAL:
                break
            time.sleep(1.0)
    console.print(f"task {task_id} {task['status']}: {task['status_reason']}")
    return 0 if task["status"] == "SUCCEEDED" else 1


def status(
    task_id: int,
    watch: Annotated[bool, typer.Option(help="show a progress bar until the task ends")] = False,
    api_url: ApiUrl = None,
) -> None:
    """Show a task's status and progress."""
    api = Api.resolve(url=api_url)
    try:
        if watch:
            raise typer.Exit(_watch(api, task_id))
        _show(api.get(f"/tasks/{task_id}"))
    except ClientError as exc:
        raise _fail(exc) from exc


def _print_line(line: dict[str, Any]) -> None:
    console.print(
        f"[dim]{line['time'][11:19]}[/dim] [cyan]{line['node']:<8}[/cyan] {line['text']}",
        markup=True,
        highlight=False,
        soft_wrap=True,
    )


def _follow(api: Api, task_id: int, node: str | None) -> None:
    """Print the log stream until the task ends, reconnecting after a dropped connection."""
    query = f"?node={node}" if node else ""
    last_id, retries = 0, 0
    while True:
        try:
            for event, data, event_id in api.events(
                f"/tasks/{task_id}/logs/stream{query}", last_id
            ):
                if event == "end":
                    err.print(f"task ended: {data['status']}")
                    return
                _print_line(data)
                last_id, retries = event_id, 0
            return
        except ClientError:
            retries += 1
            if retries > 5:
                raise
            time.sleep(min(2.0 * retries, 10.0))


def logs(
    task_id: int,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="stream until the task ends")
    ] = False,
    node: Annotated[str | None, typer.Option(help="only this node, e.g. ps, rank-2")] = None,
    api_url: ApiUrl = None,
) -> None:
    """Print a task's logs; with --follow, stream them live until the task ends."""
    api = Api.resolve(url=api_url)
    try:
        if follow:
            return _follow(api, task_id, node)
        after = 0
        while lines := api.get(
            f"/tasks/{task_id}/logs",
            params={"after_id": after, "node": node} if node else {"after_id": after},
        ):
            for line in lines:
                _print_line(line)
            after = lines[-1]["id"]
    except ClientError as exc:
        raise _fail(exc) from exc


def cancel(task_id: int, api_url: ApiUrl = None) -> None:
    """Cancel a task that has not ended."""
    try:
        task = Api.resolve(url=api_url).post(f"/tasks/{task_id}/cancel")
    except ClientError as exc:
        raise _fail(exc) from exc
    console.print(f"task {task_id} {task['status']}")


def register(app: typer.Typer) -> None:
    """Add the client commands to the `polytrain` command."""
    for command in (login, logout, submit, status, logs, cancel):
        app.command()(command)
    app.add_typer(projects_app, name="projects")
