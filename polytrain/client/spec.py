"""`polytrain submit`'s YAML task spec: which project, which code, and the task's settings.

```yaml
project: mnist                 # a project name (created if missing) or id
code: ./train.py               # a .py module or .zip/.tar.gz archive to upload ...
# entrypoint: pkg/train.py     # ... (the module inside an archive)
# requirements: ./requirements.txt  # ... (a module's own packages; an archive has its own)
# example: mnist_cnn           # ... or a bundled example
# code_version_id: 3           # ... or an existing version
name: mnist across two groups
resource_groups:
  - {name: cpu-a, workers: 2}  # {..., sharding: fsdp}: its 2 workers hold half the model each
  - {name: cpu-b, workers: 1}
epochs: 3
global_batch_size: 64
# sharding: fsdp               # every group without its own (sync_strategy sync, 2+ workers)
# fsdp_units: [TransformerBlock]  # with fsdp: the classes wrapped as units (default: by size)
```

Every other key goes to `POST /api/v1/tasks` as it is (split_policy, seed,
priority, depends_on, sharding, fsdp_units, ...), and each resource group as written: the
API validates it and names a faulty field.

`polytrain plan` reads the same file: its resource groups are the candidates (each with
the most workers the plan may use there), and `PLAN_KEYS` go to `POST /api/v1/plans`.
"""

from pathlib import Path
from typing import Any

import yaml

from polytrain.client.api import Api, ClientError

# An upload waits for the portal to resolve its requirements (two uv steps, each at most
# backend.projects.requirements.RESOLVE_TIMEOUT_S).
UPLOAD_TIMEOUT_S = 300.0
CODE_KEYS = ("code", "entrypoint", "requirements", "example", "code_version_id")
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


def find_project(api: Api, project: str | int) -> int:
    """The id of the caller's project `project` (an id or a name); never creates one.

    Raises:
        ClientError: no project the caller may see has that id or name.
    """
    if isinstance(project, int) or str(project).isdigit():
        return int(api.get(f"/projects/{project}")["id"])
    for found in api.get("/projects", params={"limit": 500, "include_archived": True}):
        if found["name"] == project:
            return int(found["id"])
    raise ClientError(f"no project named {project!r} (polytrain projects lists yours)")


def project_id(api: Api, project: str | int) -> int:
    """The id of project `project` (an id, or one of the caller's names; created if missing)."""
    try:
        return find_project(api, project)
    except ClientError:
        if isinstance(project, int) or str(project).isdigit():
            raise
        return int(api.post("/projects", json={"name": project})["id"])


def code_version_id(api: Api, project: int, spec: dict[str, Any], base: Path) -> int:
    """The code version the task trains: uploaded, from an example, or given."""
    if "code_version_id" in spec:
        return int(spec["code_version_id"])
    if "example" in spec:
        version = api.post(f"/projects/{project}/code-versions", json={"example": spec["example"]})
        return int(version["id"])
    requirements = (base / spec["requirements"]) if spec.get("requirements") else None
    version = upload_code(
        api,
        project,
        base / spec["code"],
        entrypoint=spec.get("entrypoint"),
        requirements=requirements,
    )
    return int(version["id"])


def resolve_file(api: Api, spec_file: Path) -> tuple[dict[str, Any], int, int]:
    """A task file's spec, its project's id (created if named and new) and its code
    version's id (uploaded, from an example, or given): what `submit`, `plan` and
    `sweep start` begin with. Raises ClientError."""
    spec = load(spec_file)
    project = project_id(api, spec["project"])
    return spec, project, code_version_id(api, project, spec, spec_file.parent)


def upload_code(
    api: Api,
    project: int,
    code: Path,
    *,
    entrypoint: str | None = None,
    requirements: Path | None = None,
) -> dict[str, Any]:
    """Upload a module or archive as the project's next code version; `requirements` is a
    requirements file declaring a module's own packages (an archive holds its own).
    Returns the API's code version (with its resolved `packages`).

    Raises:
        ClientError: a file is missing, or the API refused the upload (its message).
    """
    path = code.resolve()
    if not path.is_file():
        raise ClientError(f"code file {path} does not exist")
    data = {"entrypoint": entrypoint} if entrypoint else {}
    if requirements is not None:
        try:
            data["requirements"] = requirements.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ClientError(f"cannot read requirements file {requirements}: {exc}") from exc
    with path.open("rb") as fh:
        version: dict[str, Any] = api.post(
            f"/projects/{project}/code-versions/upload",
            files={"file": (path.name, fh)},
            data=data,
            timeout=UPLOAD_TIMEOUT_S,
        )
    return version


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
