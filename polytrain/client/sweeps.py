"""`polytrain sweep start|list|show|cancel`: hyperparameter sweeps through the REST API.

`polytrain sweep start sweep.yaml` reads `submit`'s task file (project, code, the task's
settings) with a `sweep:` mapping added, whose keys go to `POST /api/v1/sweeps` as they are:

```yaml
project: mnist
example: mnist_cnn
name: lr and width
resource_groups:
  - {name: cpu-a, workers: 2}
epochs: 3
global_batch_size: 64
sweep:
  algorithm: random            # or grid (every combination of listed values)
  space:
    lr: {min: 0.0001, max: 0.01, scale: log}
    hidden: [32, 64, 128]
  trials: 8
  parallel: 2                  # trials at once
  metric: val_loss
  goal: min
```
"""

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from polytrain.client import spec as task_spec
from polytrain.client.api import Api, ClientError
from polytrain.client.commands import _fail, console

sweep_app = typer.Typer(help="Hyperparameter sweeps.", no_args_is_help=True)
ApiUrl = Annotated[
    str | None,
    typer.Option(
        "--api-url", envvar="POLYTRAIN_API_URL", help="the API (default: as saved by login)"
    ),
]


def sweep_body(spec: dict[str, Any], project: int, version: int) -> dict[str, Any]:
    """The `POST /api/v1/sweeps` body of a sweep file: its `sweep:` keys, and the rest as
    the task every trial runs. Raises ClientError without a `sweep:` mapping."""
    own = spec.get("sweep")
    if not isinstance(own, dict):
        raise ClientError("the file needs a 'sweep:' mapping (space, algorithm, trials, ...)")
    task = {
        k: v
        for k, v in task_spec.task_body(spec, project, version).items()
        if k not in ("sweep", "name", "project_id", "code_version_id")
    }
    body = {**own, "project_id": project, "code_version_id": version, "task": task}
    if "name" in spec and "name" not in own:
        body["name"] = spec["name"]
    return body


def _value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _show(sweep: dict[str, Any]) -> None:
    console.print(
        f"sweep {sweep['id']}: {escape(sweep['name'])} ({sweep['status']}) · {sweep['algorithm']}"
        f", {sweep['submitted']} of {sweep['planned']} trials submitted, at most "
        f"{sweep['parallel']} at once · {sweep['goal']} {escape(sweep['metric'])}",
        highlight=False,
    )
    if sweep.get("reason"):
        console.print(f"  {escape(sweep['reason'])}", highlight=False)
    names = list(sweep["space"])
    table = Table(
        "#", *(escape(n) for n in names), "status", escape(sweep["metric"]), "epochs", "task"
    )
    best = (sweep.get("best") or {}).get("index")
    for trial in sweep["trials"]:
        status = "STOPPED" if trial["stopped_early"] else trial["status"]
        objective = trial["objective"]
        table.add_row(
            f"{trial['index']}{' ★' if trial['index'] == best else ''}",
            *(escape(_value(trial["hyperparameters"].get(n, "—"))) for n in names),
            status,
            "—" if objective is None else f"{objective:.6g}",
            str(trial["epochs"]),
            str(trial["task_id"]),
        )
    for offset, values in enumerate(sweep.get("pending") or []):
        index = len(sweep["trials"]) + offset + 1
        table.add_row(
            str(index),
            *(escape(_value(values.get(n, "—"))) for n in names),
            "waiting",
            "—",
            "—",
            "",
        )
    console.print(table)
    if sweep.get("best"):
        chosen = ", ".join(f"{k}={_value(v)}" for k, v in sweep["best"]["hyperparameters"].items())
        console.print(
            f"best: trial {best} (task {sweep['best']['task_id']}), {escape(sweep['metric'])} "
            f"{sweep['best']['objective']:.6g} with {escape(chosen)}",
            highlight=False,
        )


@sweep_app.command("start")
def start(
    spec_file: Annotated[
        Path, typer.Argument(help="the task's YAML file with a 'sweep:' mapping", exists=True)
    ],
    api_url: ApiUrl = None,
) -> None:
    """Start a sweep from a YAML file (uploading its code if it names a file)."""
    api = Api.resolve(url=api_url)
    try:
        spec, project, version = task_spec.resolve_file(api, spec_file)
        sweep = api.post("/sweeps", json=sweep_body(spec, project, version))
    except ClientError as exc:
        raise _fail(exc) from exc
    console.print(
        f"sweep {sweep['id']} started: {escape(sweep['name'])} ({sweep['planned']} trials, "
        f"{sweep['submitted']} submitted)",
        highlight=False,
    )


@sweep_app.command("list")
def list_sweeps(
    project: Annotated[str | None, typer.Option(help="only this project's (id or name)")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="sweeps to show")] = 20,
    api_url: ApiUrl = None,
) -> None:
    """List the sweeps you may see, newest first."""
    api = Api.resolve(url=api_url)
    params: dict[str, Any] = {"limit": limit}
    try:
        if project is not None:
            params["project_id"] = task_spec.find_project(api, project)
        rows, total = api.listing("/sweeps", params)
    except ClientError as exc:
        raise _fail(exc) from exc
    table = Table("id", "name", "project", "status", "trials", "objective", "created (UTC)")
    for row in rows:
        table.add_row(
            str(row["id"]),
            escape(row["name"]),
            str(row["project_id"]),
            row["status"],
            f"{row['submitted']}/{row['planned']}",
            escape(f"{row['goal']} {row['metric']}"),
            row["created_at"][:19],
        )
    console.print(table)
    console.print(f"{len(rows)} of {total} sweeps", highlight=False)


@sweep_app.command("show")
def show(sweep_id: int, api_url: ApiUrl = None) -> None:
    """A sweep's trials (hyperparameters, status, objective), the best starred."""
    try:
        sweep = Api.resolve(url=api_url).get(f"/sweeps/{sweep_id}")
    except ClientError as exc:
        raise _fail(exc) from exc
    _show(sweep)


@sweep_app.command("cancel")
def cancel(sweep_id: int, api_url: ApiUrl = None) -> None:
    """Cancel a running sweep and its unfinished trials."""
    try:
        sweep = Api.resolve(url=api_url).post(f"/sweeps/{sweep_id}/cancel")
    except ClientError as exc:
        raise _fail(exc) from exc
    console.print(f"sweep {sweep_id} {sweep['status']}", highlight=False)
