"""The client commands of `polytrain`: log in, projects, upload, plan, submit, tasks, status,
logs, download, retry, cancel."""

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
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
    # One line (a field name is never broken), the API's text never read as markup.
    err.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True, highlight=False)
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
    console.print(f"project {row['id']}: {escape(row['name'])}")


def upload(
    project: Annotated[str, typer.Argument(help="a project name (created if missing) or id")],
    code: Annotated[
        Path,
        typer.Argument(help="a .py module or a .zip/.tar.gz archive", exists=True, dir_okay=False),
    ],
    entrypoint: Annotated[
        str | None, typer.Option(help="the module inside an archive (default train.py, ...)")
    ] = None,
    requirements: Annotated[
        Path | None,
        typer.Option(
            help="a requirements file: the module's own packages, resolved by the portal to "
            "exact versions (an archive declares them in its own requirements.txt)",
            exists=True,
            dir_okay=False,
        ),
    ] = None,
    api_url: ApiUrl = None,
) -> None:
    """Upload training code as the project's next code version; prints its id and the
    packages its requirements resolved to."""
    api = Api.resolve(url=api_url)
    try:
        project_id = task_spec.project_id(api, project)
        version = task_spec.upload_code(
            api, project_id, code, entrypoint=entrypoint, requirements=requirements
        )
    except ClientError as exc:
        raise _fail(exc) from exc
    console.print(
        f"code version {version['id']} (v{version['version']}) of project {project_id}: "
        f"{escape(version['filename'])}",
        highlight=False,
    )
    for package in version.get("packages") or []:
        console.print(f"  {package['name']}=={package['version']}", highlight=False)


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
        spec, project, version = task_spec.resolve_file(api, spec_file)
        task = api.post("/tasks", json=task_spec.task_body(spec, project, version))
    except ClientError as exc:
        raise _fail(exc) from exc
    console.print(f"task {task['id']} submitted: {escape(task['name'])} ({task['status']})")
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


def tasks(
    project: Annotated[
        str | None, typer.Option(help="only this project's (its id or name)")
    ] = None,
    status: Annotated[
        str | None, typer.Option(help="only tasks in this state, e.g. RUNNING, FAILED")
    ] = None,
    tag: Annotated[
        list[str] | None, typer.Option(help="only tasks carrying this tag (repeat: all of them)")
    ] = None,
    name: Annotated[str, typer.Option(help="only tasks whose name contains this")] = "",
    limit: Annotated[int, typer.Option(min=1, max=500, help="tasks to show")] = 20,
    offset: Annotated[int, typer.Option(min=0, help="skip this many (newest first)")] = 0,
    api_url: ApiUrl = None,
) -> None:
    """List the tasks you may see, newest first: id, name, tags, project, status, progress."""
    api = Api.resolve(url=api_url)
    params: dict[str, Any] = {"limit": limit, "offset": offset, "tag": tag or [], "name": name}
    try:
        if project is not None:
            params["project_id"] = task_spec.find_project(api, project)
        if status is not None:
            params["status"] = status.upper()
        rows, total = api.listing("/tasks", params)
    except ClientError as exc:
        raise _fail(exc) from exc
    table = Table("id", "name", "tags", "project", "status", "progress", "created (UTC)")
    for row in rows:
        table.add_row(
            str(row["id"]),
            escape(row["name"]),
            escape(" ".join(row.get("tags", []))),
            str(row["project_id"]),
            row["status"],
            f"{row['progress'] * 100:.0f}%",
            row["created_at"][:19],
        )
    console.print(table)
    shown = f"{offset + 1}-{offset + len(rows)}" if rows else "none"
    console.print(f"{shown} of {total} tasks", highlight=False)


def _value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


def compare(
    task_ids: Annotated[list[int], typer.Argument(help="2 to 10 task ids")],
    api_url: ApiUrl = None,
) -> None:
    """Compare tasks: the settings that differ and each task's final metrics."""
    api = Api.resolve(url=api_url)
    try:
        found = api.get("/tasks/compare", params={"ids": task_ids})
    except ClientError as exc:
        raise _fail(exc) from exc
    heads = [f"#{t['id']}" for t in found["tasks"]]
    overview = Table("", *heads)
    overview.add_row("name", *(escape(t["name"]) for t in found["tasks"]))
    overview.add_row("status", *(t["status"] for t in found["tasks"]))
    overview.add_row("tags", *(escape(" ".join(t["tags"])) for t in found["tasks"]))
    console.print(overview)
    if found["differences"]:
        settings = Table("setting that differs", *heads)
        for diff in found["differences"]:
            settings.add_row(escape(diff["field"]), *(escape(_value(v)) for v in diff["values"]))
        console.print(settings)
    else:
        console.print("every setting is the same, the code version included")
    if found["metrics"]:
        final = Table("final metric", *heads)
        for metric in found["metrics"]:
            values = (t["final_metrics"].get(metric) for t in found["tasks"])
            final.add_row(escape(metric), *(_value(v) for v in values))
        console.print(final)


def retry(
    task_id: int,
    follow: Annotated[bool, typer.Option(help="show a progress bar until it ends")] = False,
    api_url: ApiUrl = None,
) -> None:
    """Submit an ended task again: the same code version, groups and settings, as a new task."""
    api = Api.resolve(url=api_url)
    try:
        task = api.post(f"/tasks/{task_id}/retry")
    except ClientError as exc:
        raise _fail(exc) from exc
    console.print(f"task {task['id']} submitted: {escape(task['name'])} (retry of {task_id})")
    if follow:
        raise typer.Exit(_watch(api, task["id"]))


def _checkpoint(api: Api, task_id: int, which: str) -> dict[str, Any]:
    """The task's checkpoint `which`: its id, or `latest` (the last one saved).

    Raises:
        ClientError: the task has no checkpoint, or none with that id.
    """
    found = api.get(f"/tasks/{task_id}/checkpoints", params={"limit": 500})
    if which != "latest":
        found = [c for c in found if str(c["id"]) == which]
    if not found:
        what = "no checkpoint" if which == "latest" else f"no checkpoint {which}"
        raise ClientError(f"task {task_id} has {what} (polytrain download {task_id} --help)")
    return max(found, key=lambda c: (c["step"], c["id"]))


def _save(chunks: Iterator[bytes], output: Path | None) -> int | None:
    """Write a download to `output` (standard output when None); its size in bytes, None for
    standard output. Nothing is made before the API has accepted the request, and a
    download that breaks off leaves no partial file.

    Raises:
        ClientError: refused, or the connection failed.
    """
    body = itertools.chain([next(chunks, b"")], chunks)
    if output is None:
        for chunk in body:
            typer.echo(chunk, nl=False)
        return None
    try:
        with output.open("wb") as fh:
            fh.writelines(body)
    except ClientError:
        output.unlink(missing_ok=True)
        raise
    return output.stat().st_size


def download(
    task_id: int,
    logs: Annotated[bool, typer.Option("--logs", help="the task's log as text")] = False,
    checkpoint: Annotated[
        str | None,
        typer.Option(help="a checkpoint: its id (see the task page) or `latest`"),
    ] = None,
    node: Annotated[
        str | None, typer.Option(help="with --logs: only this node, e.g. ps, rank-2")
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="write to this file (default: standard output for logs, "
            "task<ID>-checkpoint<CKPT>.pt for a checkpoint)",
            dir_okay=False,
        ),
    ] = None,
    api_url: ApiUrl = None,
) -> None:
    """Download what a task produced: its log as text (--logs: every line so far, `TIME NODE
    TEXT` per line, one node's with --node) or a checkpoint file (--checkpoint ID|latest:
    `torch.save` of the model's and optimizer's state dicts)."""
    if logs == (checkpoint is not None) or (node and not logs):
        err.print("say what to download: --logs [--node NODE], or --checkpoint ID|latest")
        raise typer.Exit(2)
    api = Api.resolve(url=api_url)
    try:
        if checkpoint is not None:
            saved = _checkpoint(api, task_id, checkpoint)
            path, params = f"/tasks/{task_id}/checkpoints/{saved['id']}/download", None
            output = output or Path(f"task{task_id}-checkpoint{saved['id']}.pt")
            what = f"checkpoint {saved['id']} (epoch {saved['epoch']}, step {saved['step']})"
        else:
            path, params = f"/tasks/{task_id}/logs.txt", {"node": node} if node else None
            what = "logs"
        size = _save(api.stream(path, params=params), output)
    except ClientError as exc:
        raise _fail(exc) from exc
    if size is not None:
        err.print(f"task {task_id} {what}: {size} bytes in {output}", highlight=False)


def cancel(task_id: int, api_url: ApiUrl = None) -> None:
    """Cancel a task that has not ended."""
    try:
        task = Api.resolve(url=api_url).post(f"/tasks/{task_id}/cancel")
    except ClientError as exc:
        raise _fail(exc) from exc
    console.print(f"task {task_id} {task['status']}")


PLAN_SHOWN = 10  # options in the table (`--json` gives them all)


def _duration(seconds: float) -> str:
    """Seconds as `4.5 s`, `12 min 5 s` or `3 h 20 min`."""
    if seconds < 59.95:
        return f"{max(0.0, seconds):.1f} s"
    whole = round(seconds)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


def _groups(workers: dict[str, int]) -> str:
    return " + ".join(f"{name} × {n}" for name, n in workers.items())


def _same(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    return bool(a and b and a["workers"] == b["workers"] and a["split_policy"] == b["split_policy"])


def _show_plan(plan: dict[str, Any]) -> None:
    """The plan's options (fastest first, the recommendation marked), each candidate group's
    effect or why it is left out, and the deadline answer."""
    best, for_deadline = plan["best"], plan["for_deadline"]
    console.print(
        f"plan {plan['id']} ready: {len(plan['options'])} options predicted from trial task "
        f"{plan['trial_task_id']}",
        highlight=False,
    )
    table = Table("", "groups and workers", "split", "step s", "epoch s", "finish", "samples/s")
    shown = plan["options"][:PLAN_SHOWN]
    if for_deadline and not any(_same(o, for_deadline) for o in shown):
        shown.append(for_deadline)
    for option in shown:
        mark = "★" if _same(option, best) else "⏱" if _same(option, for_deadline) else ""
        table.add_row(
            mark,
            _groups(option["workers"]),
            option["split_policy"],
            f"{option['step_s']:.3f}",
            f"{option['epoch_s']:.1f}",
            _duration(option["finish_s"]),
            f"{option['samples_per_s']:.1f}",
            style="bold" if mark == "★" else None,
        )
    console.print(table)
    if len(plan["options"]) > len(shown):
        console.print(f"({len(plan['options']) - len(shown)} slower options: --json lists all)")
    console.print(
        f"★ recommended: {_groups(best['workers'])}, {best['split_policy']} split, about "
        f"{_duration(best['finish_s'])} to finish ({best['samples_per_s']:.1f} samples/s)",
        highlight=False,
        soft_wrap=True,
    )
    for group in [g["name"] for g in plan["request"]["resource_groups"]]:
        gain = plan["marginal_gain_s"].get(group)
        used = best["workers"].get(group)
        if group in plan["left_out"]:
            line = f"  {group}: left out: {plan['left_out'][group]}"
        elif used and gain is not None:
            verb = "saves" if gain >= 0 else "costs"
            line = f"  {group}: {used} worker(s), {verb} {abs(gain):.1f} s of the time to finish"
        elif used:  # null: no option of the other groups can run the task
            line = f"  {group}: {used} worker(s), cannot be left out"
        else:
            line = f"  {group}: {used or 0} worker(s)"
        console.print(line, highlight=False, soft_wrap=True, markup=False)
    if plan["deadline"]:
        if for_deadline:
            console.print(
                f"⏱ deadline {plan['deadline']}: {_groups(for_deadline['workers'])} "
                f"({for_deadline['split_policy']} split) is the fewest workers predicted to "
                f"make it (about {_duration(for_deadline['finish_s'])}); --submit takes it",
                highlight=False,
                soft_wrap=True,
            )
        else:
            console.print(
                f"⏱ deadline {plan['deadline']}: no option is predicted to make it (the "
                f"fastest takes about {_duration(best['finish_s'])})",
                highlight=False,
                soft_wrap=True,
            )


def _interrupted(plan: dict[str, Any]) -> typer.Exit:
    err.print(
        f"stopped waiting: plan {plan['id']} keeps running (trial task "
        f"{plan['trial_task_id']}). See it with `polytrain plan-show {plan['id']}`; "
        f"cancel it with `polytrain plan-cancel {plan['id']}`.",
        highlight=False,
    )
    return typer.Exit(130)


def _wait_plan(api: Api, plan: dict[str, Any]) -> dict[str, Any]:
    """Poll the plan every second until its trial reported (or it failed or was cancelled),
    with a spinner on stderr. Ctrl-C stops waiting, not the plan."""
    started = time.monotonic()
    try:
        with err.status("") as spinner:
            while plan["status"] == "trial":
                trial = api.get(f"/tasks/{plan['trial_task_id']}")
                spinner.update(
                    f"plan {plan['id']}: trial task {plan['trial_task_id']} {trial['status']}, "
                    f"{time.monotonic() - started:.0f} s (Ctrl-C stops waiting)"
                )
                time.sleep(1.0)
                plan = api.get(f"/plans/{plan['id']}")
    except KeyboardInterrupt:
        raise _interrupted(plan) from None
    return plan


def _finish_plan(
    api: Api, plan: dict[str, Any], *, wait: bool, as_json: bool
) -> dict[str, Any] | None:
    """Wait for the plan (unless `wait` is off), print it; the ready plan, or None when it is
    still in its trial (`--no-wait`). Raises typer.Exit(1) when it failed or was cancelled."""
    if wait:
        plan = _wait_plan(api, plan)
    if as_json:
        typer.echo(json.dumps(plan, indent=2))
    if plan["status"] == "trial":
        if not as_json:
            console.print(
                f"plan {plan['id']} in its trial: see it with `polytrain plan-show "
                f"{plan['id']} --wait`, cancel it with `polytrain plan-cancel {plan['id']}`",
                highlight=False,
                soft_wrap=True,
            )
        return None
    if plan["status"] != "ready":
        reason = plan["error"] or "no reason given"
        err.print(
            f"[red]error:[/red] plan {plan['id']} {plan['status']}: {escape(reason)}",
            soft_wrap=True,
            highlight=False,
        )
        raise typer.Exit(1)
    if not as_json:
        _show_plan(plan)
    return plan


def plan(
    spec_file: Annotated[
        Path,
        typer.Argument(
            help="the task's YAML (or JSON) spec, as for submit", exists=True, dir_okay=False
        ),
    ],
    deadline: Annotated[
        str | None,
        typer.Option(
            help="when the task must have finished (ISO, UTC, e.g. 2026-11-27T09:00:00Z): "
            "the plan names the fewest workers predicted to make it"
        ),
    ] = None,
    wait: Annotated[bool, typer.Option(help="wait for the trial and show the predictions")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
    submit_task: Annotated[
        bool,
        typer.Option(
            "--submit", help="then submit the task as planned (groups, workers, split, plan id)"
        ),
    ] = False,
    api_url: ApiUrl = None,
) -> None:
    """Plan a task before training it: a short trial on the file's resource groups times its
    model, then every subset of the groups is predicted and the fastest recommended."""
    api = Api.resolve(url=api_url)
    try:
        spec, project, version = task_spec.resolve_file(api, spec_file)
        created = api.post("/plans", json=task_spec.plan_body(spec, project, version, deadline))
        if not as_json:
            groups = ", ".join(g["name"] for g in created["request"]["resource_groups"])
            console.print(
                f"plan {created['id']}: trial task {created['trial_task_id']} queued on {groups}",
                highlight=False,
            )
        ready = _finish_plan(api, created, wait=wait or submit_task, as_json=as_json)
        if submit_task and ready is not None:
            body = task_spec.planned_task_body(spec, project, version, ready["task_request"])
            task = api.post("/tasks", json=body)
            eta = f", about {_duration(task['eta_s'])} to finish" if task["eta_s"] else ""
            (err if as_json else console).print(
                f"task {task['id']} submitted from plan {ready['id']}: {escape(task['name'])} "
                f"({task['status']}{eta})",
                highlight=False,
            )
    except ClientError as exc:
        raise _fail(exc) from exc


def plan_show(
    plan_id: int,
    wait: Annotated[bool, typer.Option(help="wait while its trial runs")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
    api_url: ApiUrl = None,
) -> None:
    """Show a plan: its trial's state, or its predictions once ready."""
    api = Api.resolve(url=api_url)
    try:
        _finish_plan(api, api.get(f"/plans/{plan_id}"), wait=wait, as_json=as_json)
    except ClientError as exc:
        raise _fail(exc) from exc


def plan_cancel(plan_id: int, api_url: ApiUrl = None) -> None:
    """Cancel a plan's trial task (its workers are released)."""
    try:
        found = Api.resolve(url=api_url).post(f"/plans/{plan_id}/cancel")
    except ClientError as exc:
        raise _fail(exc) from exc
    console.print(f"plan {plan_id} {found['status']}")


def register(app: typer.Typer) -> None:
    """Add the client commands to the `polytrain` command."""
    commands = (
        login,
        logout,
        upload,
        plan,
        submit,
        tasks,
        compare,
        status,
        logs,
        download,
        retry,
        cancel,
    )
    for command in commands:
        app.command()(command)
    app.command("plan-show")(plan_show)
    app.command("plan-cancel")(plan_cancel)
    app.add_typer(projects_app, name="projects")
    from polytrain.client.sweeps import sweep_app  # it uses this module's console and _fail

    app.add_typer(sweep_app, name="sweep")
