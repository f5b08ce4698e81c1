"""`polytrain submit`'s YAML task spec: which project, which code, and the task's settings.

```yaml
project: mnist                 # a project name (created if missing) or id
code: ./train.py               # a .py module or .zip/.tar.gz archive to upload ...
# entrypoint: pkg/train.py     # ... (the module inside an archive)
# example: mnist_cnn           # ... or a bundled example
# code_version_id: 3           # ... or an existing version
name: mnist across two groups
resource_groups:
  - {name: cpu-a, workers: 2}
  - {name: cpu-b, workers: 1}
epochs: 3
global_batch_size: 64
```

Every other key goes to `POST /api/v1/tasks` as it is (split_policy, seed,
priority, depends_on, ...): the API validates it and names a faulty field.

`polytrain plan` reads the same file: its resource groups are the candidates (each with
the most workers the plan may use there), and `PLAN_KEYS` go to `POST /api/v1/plans`.
"""

from pathlib import Path
from typing import Any

import yaml

from polytrain.client.api import Api, ClientError

CODE_KEYS = ("code", "entrypoint", "example", "code_version_id")
# What a plan takes from the task file (POST /api/v1/plans); the rest is the task's own.
PLAN_KEYS = (
    "name",
    "resource_groups",
    "global_batch_size",
    "epochs",
    "sync_strategy",
    "sync_period",
    "quorum",
    "seed",
)
# What a plan's `task_request` decides when the planned task is submitted.
PLANNED_KEYS = (*PLAN_KEYS, "split_policy", "plan_id")


def load(path: Path) -> dict[str, Any]:
    """The spec file as a dict. Raises ClientError for unreadable YAML or a missing key."""
    try:
        spec = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ClientError(f"cannot read {path}: {exc}") from exc
    if not isinstance(spec, dict) or "project" not in spec:
        raise ClientError(f"{path}: a mapping with at least 'project' is expected")
    if not any(key in spec for key in ("code", "example", "code_version_id")):
        raise ClientError(f"{path}: give 'code' (a file), 'example' or 'code_version_id'")
    return spec


def project_id(api: Api, project: str | int) -> int:
    """The id of project `project` (an id, or one of the caller's names; created if missing)."""
    if isinstance(project, int) or str(project).isdigit():
        return int(api.get(f"/projects/{project}")["id"])
    for found in api.get("/projects", params={"limit": 500}):
        if found["name"] == project:
            return int(found["id"])
    return int(api.post("/projects", json={"name": project})["id"])


def code_version_id(api: Api, project: int, spec: dict[str, Any], base: Path) -> int:
    """The code version the task trains: uploaded, from an example, or given."""
    if "code_version_id" in spec:
        return int(spec["code_version_id"])
    if "example" in spec:
        version = api.post(f"/projects/{project}/code-versions", json={"example": spec["example"]})
        return int(version["id"])
    path = (base / spec["code"]).resolve()
    if not path.is_file():
        raise ClientError(f"code file {path} does not exist")
    data = {"entrypoint": spec["entrypoint"]} if spec.get("entrypoint") else {}
    with path.open("rb") as fh:
        version = api.post(
            f"/projects/{project}/code-versions/upload", files={"file": (path.name, fh)}, data=data
        )
    return int(version["id"])


def task_body(spec: dict[str, Any], project: int, version: int) -> dict[str, Any]:
    body = {k: v for k, v in spec.items() if k not in (*CODE_KEYS, "project")}
    return {**body, "project_id": project, "code_version_id": version}


def plan_body(
    spec: dict[str, Any], project: int, version: int, deadline: str | None = None
) -> dict[str, Any]:
    """The `POST /api/v1/plans` body of a task file: its groups as the candidates, and its
    batch, epochs, sync settings and seed when it gives them."""
    body = {k: spec[k] for k in PLAN_KEYS if k in spec}
    body.update(project_id=project, code_version_id=version)
    if deadline:
        body["deadline"] = deadline
    return body


def planned_task_body(
    spec: dict[str, Any], project: int, version: int, task_request: dict[str, Any]
) -> dict[str, Any]:
    """The task to submit from a plan: the plan's `task_request` (groups, workers, split,
    sync settings, `plan_id`) with the file's other settings (priority, limits, ...)."""
    own = {k: v for k, v in task_body(spec, project, version).items() if k not in PLANNED_KEYS}
    return {**own, **task_request}
