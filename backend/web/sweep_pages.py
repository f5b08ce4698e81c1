"""Portal pages of hyperparameter sweeps: a project's sweeps with the form that starts one,
and one sweep's page (every trial, the best highlighted, the metric against each
hyperparameter charted by frontend/static/sweep_charts.js); cancel."""

import json
from typing import Annotated, Any

from fastapi import APIRouter, Form, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from sqlalchemy.orm import Session

from backend.auth.dependencies import CsrfCheck, WebUser
from backend.auth.models import User
from backend.core.dependencies import SessionDep
from backend.core.errors import ServiceError
from backend.projects import access as project_access
from backend.projects import service as projects
from backend.projects.models import Project
from backend.resource_groups.models import ResourceGroup
from backend.sweeps import service as sweeps
from backend.sweeps.router import check_creation, readable_sweep
from backend.sweeps.schemas import SweepCreate
from backend.web.forms import FORM_ERROR, FieldErrors, validation_errors
from backend.web.templating import redirect, render

router = APIRouter(include_in_schema=False)


class SweepForm(BaseModel):
    """The start-a-sweep form as entered (strings, shown again as typed after a refusal)."""

    code_version_id: str = ""
    name: str = ""
    groups: str = ""  # "cpu-a:2, cpu-b:1"
    epochs: str = "3"
    global_batch_size: str = "64"
    task_extra: str = ""  # other task settings, a JSON object
    algorithm: str = "grid"
    space: str = '{"lr": [0.01, 0.001], "hidden": [32, 64]}'
    trials: str = ""
    parallel: str = "2"
    metric: str = "val_loss"
    goal: str = "min"
    seed: str = "0"
    early_stopping: str = "median"


# Where an error of the API's body shows on the form.
FORM_FIELDS = {
    "task.resource_groups": "groups",
    "task.epochs": "epochs",
    "task.global_batch_size": "global_batch_size",
}
OWN_FIELDS = set(SweepForm.model_fields)


def _form_field(field: str) -> str:
    for prefix, name in FORM_FIELDS.items():
        if field == prefix or field.startswith(prefix + "."):
            return name
    if field.startswith("task.") or field == "task":
        return "task_extra"
    head = field.split(".", 1)[0]
    return head if head in OWN_FIELDS else FORM_ERROR


def _groups(text: str) -> list[dict[str, Any]]:
    """`cpu-a:2, cpu-b` -> [{"name": "cpu-a", "workers": 2}, {"name": "cpu-b", "workers": 1}].
    Raises ValueError naming a malformed item."""
    found = []
    for item in (part.strip() for part in text.replace("\n", ",").split(",")):
        if not item:
            continue
        name, _, count = item.partition(":")
        if not count.strip():
            count = "1"
        if not count.strip().isdigit():
            raise ValueError(f"{item!r}: write a group as NAME or NAME:WORKERS")
        found.append({"name": name.strip(), "workers": int(count)})
    if not found:
        raise ValueError("name at least one group, e.g. cpu-a:2")
    return found


def _number(text: str, field: str, errors: FieldErrors) -> int | None:
    if not text.strip():
        return None
    try:
        return int(text.strip())
    except ValueError:
        errors[field] = "a whole number"
        return None


def _body(project: Project, form: SweepForm) -> tuple[dict[str, Any], FieldErrors]:
    """The `POST /api/v1/sweeps` body of the form, or the errors of what cannot be read."""
    errors: FieldErrors = {}
    task: dict[str, Any] = {}
    if form.task_extra.strip():
        try:
            task = json.loads(form.task_extra)
            if not isinstance(task, dict):
                raise ValueError
        except ValueError:
            errors["task_extra"] = 'a JSON object of task settings, e.g. {"split_policy": "even"}'
    try:
        task["resource_groups"] = _groups(form.groups)
    except ValueError as exc:
        errors["groups"] = str(exc)
    for field in ("epochs", "global_batch_size"):
        value = _number(getattr(form, field), field, errors)
        if value is not None:
            task[field] = value
    try:
        space = json.loads(form.space)
    except ValueError:
        errors["space"] = 'a JSON object, e.g. {"lr": [0.01, 0.001]}'
        space = {}
    body: dict[str, Any] = {
        "project_id": project.id,
        "code_version_id": _number(form.code_version_id, "code_version_id", errors) or 0,
        "name": form.name.strip(),
        "task": task,
        "algorithm": form.algorithm,
        "space": space,
        "metric": form.metric.strip(),
        "goal": form.goal,
        "early_stopping": form.early_stopping,
    }
    for field in ("trials", "parallel", "seed"):
        value = _number(getattr(form, field), field, errors)
        if value is not None:
            body[field] = value
    return body, errors


def start_sweep(
    session: Session, project: Project, form: SweepForm, user: User
) -> tuple[int | None, FieldErrors]:
    """Create the sweep of the form, or return the errors keyed by the form's fields (the
    access checks are REST's: `backend.sweeps.router.check_creation`)."""
    body, errors = _body(project, form)
    if errors:
        return None, errors
    try:
        data = SweepCreate.model_validate(body)
        check_creation(session, user=user, data=data)
        sweep = sweeps.create(session, data=data, user_id=user.id)
    except ValidationError as exc:
        found: FieldErrors = {}
        for field, message in validation_errors(exc).items():
            found.setdefault(_form_field(field), f"{field}: {message}")
        return None, found
    except ServiceError as exc:
        session.rollback()
        return None, {_form_field(exc.field or ""): exc.message}
    return sweep.id, {}


def _sweeps_page(
    session: Session,
    user: User,
    project: Project,
    form: SweepForm | None = None,
    errors: FieldErrors | None = None,
) -> dict[str, Any]:
    rows, total = sweeps.list_sweeps(session, project_id=project.id, limit=100)
    versions = projects.list_versions(session, project_id=project.id)
    form = form or SweepForm(
        code_version_id=str(versions[0].id) if versions else "",
        groups=", ".join(
            f"{g.name}:1" for g in session.query(ResourceGroup).order_by(ResourceGroup.id).limit(1)
        ),
    )
    return {
        "project": project,
        "sweeps": [sweeps.summary(s) for s in rows],
        "total": total,
        "versions": versions,
        "form": form,
        "errors": errors or {},
        "archived": project.archived_at is not None,
    }


@router.get("/projects/{project_id}/sweeps")
def project_sweeps(
    request: Request, project_id: int, session: SessionDep, user: WebUser
) -> Response:
    """A project's sweeps, newest first, and the form that starts one."""
    project = project_access.readable_project(session, user=user, project_id=project_id)
    return render(request, "sweeps.html", _sweeps_page(session, user, project))


@router.post("/projects/{project_id}/sweeps", dependencies=[CsrfCheck])
def create_sweep(
    request: Request,
    project_id: int,
    session: SessionDep,
    user: WebUser,
    form: Annotated[SweepForm, Form()],
) -> Response:
    """Start a sweep from the form and open its page; a refusal shows the form again as
    entered, each message beside its field."""
    project = project_access.writable_project(session, user=user, project_id=project_id)
    sweep_id, errors = start_sweep(session, project, form, user)
    if sweep_id is None:
        page = _sweeps_page(session, user, project, form, errors)
        return render(request, "sweeps.html", page, status_code=422)
    return redirect(f"/sweeps/{sweep_id}", flash=f"Sweep {sweep_id} started.")


def chart_data(detail: dict[str, Any]) -> dict[str, Any]:
    """What the page's charts draw: per hyperparameter, each scored trial's value and
    objective (numbers as numbers, anything else by its text), the best trial's index."""
    points = []
    for trial in detail["trials"]:
        if trial["objective"] is None:
            continue
        points.append(
            {
                "index": trial["index"],
                "values": trial["hyperparameters"],
                "objective": trial["objective"],
                "stopped": trial["stopped_early"],
            }
        )
    return {
        "metric": detail["metric"],
        "goal": detail["goal"],
        "names": list(detail["space"]),
        "log": [n for n, s in detail["space"].items() if s.get("scale") == "log"],
        "points": points,
        "best": detail["best"]["index"] if detail["best"] else None,
    }


@router.get("/sweeps/{sweep_id}")
def sweep_page(request: Request, sweep_id: int, session: SessionDep, user: WebUser) -> Response:
    """A sweep: settings, every trial (the best highlighted), and the charts."""
    sweep = readable_sweep(session, user=user, sweep_id=sweep_id)
    project = session.get_one(Project, sweep.project_id)
    detail = sweeps.detail(session, sweep)
    return render(
        request,
        "sweep.html",
        {
            "project": project,
            "sweep": detail,
            "chart": chart_data(detail),
            "names": list(detail["space"]),
        },
    )


@router.post("/sweeps/{sweep_id}/cancel", dependencies=[CsrfCheck])
def cancel_sweep(sweep_id: int, session: SessionDep, user: WebUser) -> Response:
    """Cancel the sweep and its unfinished trials."""
    sweep = readable_sweep(session, user=user, sweep_id=sweep_id)
    try:
        sweeps.cancel(session, sweep=sweep)
    except ServiceError as exc:
        return redirect(f"/sweeps/{sweep_id}", flash=exc.message, kind="error")
    return redirect(f"/sweeps/{sweep_id}", flash=f"Sweep {sweep_id} cancelled.")
