"""The task submission form, built from `TaskCreate` so that every field it has is offered.

Fields with choices become selects, numbers become number inputs with the schema's
bounds, a list of names (`fsdp_units`) a text input of comma-separated names, a mapping
(`hyperparameters`) a text input of a JSON object, and a nested settings model (one level)
becomes a group of inputs named `parent.child`. Resource groups, the code version (or a
bundled example) and dependencies have their own widgets; `plan_id` is a hidden input that
the page's "Use this plan" button sets (frontend/static/plan.js). "Run again" fills the form
from a task's spec (`form_from_task`).
"""

import json
import re
import types
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt, MaxLen
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo
from sqlalchemy.orm import Session

from backend.auth.dependencies import CSRF_FIELD
from backend.core.errors import ServiceError
from backend.projects import service as projects
from backend.projects.models import Project
from backend.tasks import service as tasks
from backend.tasks.models import Task
from backend.tasks.schemas import TaskCreate
from backend.tasks.spec import read_spec
from backend.web.forms import FORM_ERROR, FieldErrors, service_errors, validation_errors
from contracts.plan import DILOCO_PERIOD
from contracts.task_spec import TaskSpec

EXAMPLE_PREFIX = "example:"
OWN_WIDGETS = {
    "project_id",
    "code_version_id",
    "name",
    "resource_groups",
    "depends_on",
    "plan_id",
}
# Shown at once; every other setting sits under "More settings".
BASIC = {
    "epochs",
    "global_batch_size",
    "split_policy",
    "sync_strategy",
    "priority",
    "tags",
    "hyperparameters",
}
_GROUP_FIELD = re.compile(r"^resource_groups\.(\d+)(\..*)?$")


@dataclass(frozen=True)
class FormField:
    """One input of the form: `kind` is `select`, `number` or `text`; `names`: a text input
    of comma-separated names that the schema takes as a list; `mapping`: a text input of a
    JSON object that the schema takes as a dict."""

    name: str
    label: str
    kind: str
    default: str
    options: tuple[str, ...] = ()
    attrs: dict[str, str] = field(default_factory=dict)
    hint: str = ""
    names: bool = False
    mapping: bool = False

    @property
    def basic(self) -> bool:
        return self.name in BASIC


def _plain(annotation: Any) -> Any:
    """`X | None` -> X."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _bounds(info: FieldInfo) -> dict[str, str]:
    attrs = {}
    for meta in info.metadata:
        if isinstance(meta, Ge | Gt):
            attrs["min"] = str(meta.ge if isinstance(meta, Ge) else meta.gt)
        if isinstance(meta, Le | Lt):
            attrs["max"] = str(meta.le if isinstance(meta, Le) else meta.lt)
    return attrs


def _text(value: Any) -> str:
    """A setting's value as its input holds it: a list as comma-separated names, a mapping as
    a JSON object (blank when empty), a bool as `true`/`false`, None blank."""
    if isinstance(value, dict):
        return json.dumps(value) if value else ""
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _default(info: FieldInfo) -> str:
    return _text(None if info.is_required() else info.get_default(call_default_factory=True))


def _names(kind: Any) -> bool:
    """Whether `kind` is a list of strings (constrained or not), typed as names in one input."""
    if get_origin(kind) is not list:
        return False
    item = get_args(kind)[0]
    return item is str or (get_origin(item) is Annotated and get_args(item)[0] is str)


def _widget(kind: Any, info: FieldInfo) -> tuple[str, tuple[str, ...], dict[str, str]] | None:
    """(input kind, select options, input attributes) for a field's type; None: no widget."""
    if get_origin(kind) is Literal:
        return "select", tuple(map(str, get_args(kind))), {}
    if kind is bool:
        return "select", ("true", "false"), {}
    if kind in (int, float):
        return "number", (), {"step": "1" if kind is int else "any", **_bounds(info)}
    if _names(kind) or get_origin(kind) is dict:
        return "text", (), {}
    return ("text", (), {}) if kind is str else None


# Fields whose default depends on the sync strategy chosen beside them (TaskCreate sets it
# when they are left out): the form leaves them blank, so a diloco task gets its round of 16
# and the non-blocking exchanges their epoch-end rebalancing unless the user types a value.
STRATEGY_DEFAULTS = frozenset({"sync_period", "rebalance_every"})


def _field(name: str, info: FieldInfo) -> FormField | None:
    kind = _plain(info.annotation)
    widget = _widget(kind, info)
    if widget is None:
        return None
    label = info.title or name.rsplit(".", 1)[-1].replace("_", " ").capitalize()
    return FormField(
        name=name,
        label=label,
        kind=widget[0],
        default="" if name in STRATEGY_DEFAULTS else _default(info),
        options=widget[1],
        attrs=widget[2],
        hint=(info.description or "").replace("`", "")
        + ("; separate names with commas" if _names(kind) else ""),
        names=_names(kind),
        mapping=get_origin(kind) is dict,
    )


def task_fields() -> list[FormField]:
    """The settings inputs of the form, in the schema's order (nested models flattened)."""
    found: list[FormField] = []
    for name, info in TaskCreate.model_fields.items():
        if name in OWN_WIDGETS:
            continue
        kind = _plain(info.annotation)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            found.extend(
                f
                for sub, sub_info in kind.model_fields.items()
                if (f := _field(f"{name}.{sub}", sub_info))
            )
        elif (form_field := _field(name, info)) is not None:
            found.append(form_field)
    return found


def has_dependencies() -> bool:
    return "depends_on" in TaskCreate.model_fields


class TaskForm(BaseModel):
    """The submission form as entered: `group[i]` asks for `workers[i]` workers, held as
    `group_sharding[i]` says (blank: the task's `sharding`) with at most `group_cap[i]`
    samples a worker a step (its `max_local_batch`, blank: no cap); the settings inputs
    arrive as extra fields named as in `task_fields()`; `plan_id` is the plan the task
    follows (set by "Use this plan", blank for none)."""

    model_config = ConfigDict(extra="allow")

    name: str = ""
    code_version_id: str = ""
    group: list[str] = []
    workers: list[str] = []
    group_sharding: list[str] = []
    group_cap: list[str] = []
    depends_on: list[str] = []
    plan_id: str = ""

    def sharding_of(self, group_name: str) -> str:
        """The sharding entered for `group_name` ("" for the task's)."""
        return dict(zip(self.group, self.group_sharding, strict=False)).get(group_name, "")

    def cap_of(self, group_name: str) -> str:
        """The cap on a worker's samples entered for `group_name` ("" for none)."""
        return dict(zip(self.group, self.group_cap, strict=False)).get(group_name, "")

    def value(self, form_field: FormField) -> str:
        """What was entered in `form_field` (its default on a new form)."""
        return str((self.model_extra or {}).get(form_field.name, form_field.default))

    def workers_of(self, group_name: str) -> str:
        """What was entered for `group_name` ("0" when the group was not in the form)."""
        return dict(zip(self.group, self.workers, strict=False)).get(group_name, "0")


AGAIN = " (again)"


def _strategy_default(name: str, spec: TaskSpec) -> Any:
    """What TaskCreate gives a `STRATEGY_DEFAULTS` field left out, for `spec`'s strategy."""
    if name == "sync_period":
        diloco = spec.sync_strategy == "diloco"
        return DILOCO_PERIOD if diloco else TaskCreate.model_fields[name].default
    if (spec.diloco_exchange or "blocking") != "blocking":
        return 0  # rebalance_every: epoch ends only (TaskCreate._check)
    return TaskCreate.model_fields[name].default


def _stored_settings(task: Task, spec: TaskSpec) -> dict[str, str]:
    """Each settings input's value as `task` was run: from its spec (a nested model's keys
    as `parent.child`, the limits as their own fields), its priority and restarts from the
    task; a strategy-dependent field that holds its strategy's default stays blank, so that
    a changed strategy gets its own."""
    stored: dict[str, Any] = spec.model_dump(mode="json")
    for parent, value in list(stored.items()):
        if isinstance(value, dict):
            stored.update({f"{parent}.{key}": sub for key, sub in value.items()})
    stored.update(stored.get("limits") or {})
    stored.update(priority=task.priority, max_restarts=task.max_restarts, tags=task.tags)
    settings = {}
    for form_field in task_fields():
        value = stored.get(form_field.name)
        if value is None:
            continue  # not stored (an older task): the form's default
        if form_field.name in STRATEGY_DEFAULTS and value == _strategy_default(
            form_field.name, spec
        ):
            value = None
        settings[form_field.name] = _text(value)
    return settings


def form_from_task(task: Task) -> TaskForm:
    """The submission form filled from `task` for "Run again": its code version, its named
    groups with their workers, sharding and cap, every setting the form has as the task
    stored it, its dependencies and plan, and its name with " (again)". The project page
    shows it as it shows a refused form's values; what is submitted is a new task.

    A device-type request item, emulated speed factors and preprocessing steps have no input
    in the form (`not_in_form`).

    Raises:
        Conflict: `task` is a plan's trial (its timings belong to that plan).
    """
    spec = read_spec(task)
    tasks.refuse_trial(task, spec, "fill the submit form and press Plan to plan again instead")
    named = [item for item in spec.requested() if item.name]
    name = task.name.removesuffix(AGAIN)
    max_name = next(
        m.max_length for m in TaskCreate.model_fields["name"].metadata if isinstance(m, MaxLen)
    )
    return TaskForm.model_validate(
        {
            **_stored_settings(task, spec),
            "name": name[: max_name - len(AGAIN)] + AGAIN,
            "code_version_id": str(task.code_version_id),
            "group": [item.name for item in named],
            "workers": [str(item.workers) for item in named],
            "group_sharding": [item.sharding or "" for item in named],
            "group_cap": [_text(item.max_local_batch) for item in named],
            "depends_on": [str(dep) for dep in spec.depends_on],
            "plan_id": _text(spec.plan_id),
        }
    )


def not_in_form(task: Task) -> list[str]:
    """What `task` was given that the form has no input for, so "Run again" leaves out."""
    spec = read_spec(task)
    left = [
        f"the request of {item.workers} {item.device_type} worker(s) by device type"
        for item in spec.requested()
        if not item.name
    ]
    if any(item.speed_factor != 1.0 for item in spec.requested()):
        left.append("emulated speed factors")
    if spec.preprocess:
        left.append("preprocessing steps")
    return left


def _group_requests(form: TaskForm) -> tuple[list[dict], FieldErrors]:
    """The groups asked for (workers > 0, blank = 0) and errors of unreadable entries."""
    requests, errors = [], {}
    if len(form.group) != len(form.workers):
        return [], {
            "resource_groups": f"{len(form.group)} groups but {len(form.workers)} "
            "worker counts: give one count per group"
        }
    for name, raw in zip(form.group, form.workers, strict=True):
        try:
            workers = int(raw.strip() or "0")
        except ValueError:
            errors[f"group.{name}"] = "enter a whole number of workers (0 = not used)"
            continue
        if workers == 0:
            continue
        item: dict[str, Any] = {"name": name, "workers": workers}
        if sharding := form.sharding_of(name).strip():
            item["sharding"] = sharding  # checked by TaskCreate, which names the choices
        if cap := form.cap_of(name).strip():
            try:
                item["max_local_batch"] = int(cap)
            except ValueError:
                errors[f"group.{name}"] = (
                    "enter a whole number of samples a worker may take a step (blank: no cap)"
                )
                continue
        requests.append(item)
    return requests, errors


def _to_form_fields(errors: FieldErrors, names: list[str]) -> FieldErrors:
    """Re-key `resource_groups.I...` errors to `group.NAME`, and `depends_on.I`, a list of
    names' `FIELD.I` (`fsdp_units.0`) or a mapping's `FIELD.KEY` (`hyperparameters.lr`) to
    the field's own input."""
    lists = {"depends_on", *(f.name for f in task_fields() if f.names or f.mapping)}
    keyed: FieldErrors = {}
    for key, message in errors.items():
        match = _GROUP_FIELD.match(key)
        if match and int(match.group(1)) < len(names):
            key = f"group.{names[int(match.group(1))]}"
        elif key.partition(".")[0] in lists:
            key = key.partition(".")[0]
        keyed.setdefault(key, message)
    return keyed


# What a mapping's refused input is shown as an example of.
MAPPING_EXAMPLES = {
    "hyperparameters": '{"lr": 0.003, "hidden": 128}',
    "agreement_tolerance": '{"cpu/cuda": 0.001}',
}


def _mapping(raw: str) -> dict[str, Any] | None:
    """The JSON object typed in a mapping's input; None when it is not one."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _settings(form: TaskForm) -> tuple[dict[str, Any], FieldErrors]:
    """The settings inputs as TaskCreate's fields, and errors of inputs it could not read."""
    payload: dict[str, Any] = {}
    errors: FieldErrors = {}
    for form_field in task_fields():
        raw = form.value(form_field).strip()
        if raw == "":
            continue
        value: str | list[str] | dict[str, Any] = raw
        if form_field.names:
            value = [name.strip() for name in raw.split(",") if name.strip()]
        if form_field.mapping:
            mapping = _mapping(raw)
            if mapping is None:
                errors[form_field.name] = (
                    "enter a JSON object of names and values, e.g. "
                    + MAPPING_EXAMPLES.get(form_field.name, '{"name": 1}')
                )
                continue
            value = mapping
        parent, _, child = form_field.name.partition(".")
        if child:
            payload.setdefault(parent, {})[child] = value
        else:
            payload[parent] = value
    return payload, errors


def _payload(
    project_id: int, version_id: int | str, form: TaskForm, requests: list[dict]
) -> tuple[dict[str, Any], FieldErrors]:
    settings, errors = _settings(form)
    payload = {
        **settings,
        "project_id": project_id,
        "code_version_id": version_id,
        "name": form.name,
        "resource_groups": requests,
    }
    if has_dependencies():
        payload["depends_on"] = [v for v in form.depends_on if v.strip()]
    if form.plan_id.strip():
        payload["plan_id"] = form.plan_id.strip()
    return payload, errors


def _unknown_fields(form: TaskForm) -> FieldErrors:
    """An error naming the first posted field this form does not have (none: {})."""
    known = {f.name for f in task_fields()} | {CSRF_FIELD}
    unknown = sorted(set(form.model_extra or {}) - known)
    if not unknown:
        return {}
    shown = unknown[0].encode("unicode_escape").decode()[:100]
    return {FORM_ERROR: f"{shown}: not a field of this form"}


def _task_create(project_id: int, form: TaskForm) -> tuple[TaskCreate | None, FieldErrors]:
    requests, errors = _group_requests(form)
    errors.update(_unknown_fields(form))
    if not requests and not errors:
        errors["resource_groups"] = "give at least one resource group some workers"
    if not form.code_version_id:
        errors["code_version_id"] = "choose a code version or a bundled example"
    version_id = 0 if form.code_version_id.startswith(EXAMPLE_PREFIX) else form.code_version_id
    payload, unread = _payload(project_id, version_id, form, requests)
    errors.update(unread)
    try:
        data = TaskCreate.model_validate(payload)
    except ValidationError as exc:
        found = _to_form_fields(validation_errors(exc), [r["name"] for r in requests])
        return None, {**found, **errors}
    return (None, errors) if errors else (data, {})


def submit_task(
    session: Session, project: Project, form: TaskForm, user_id: int | None = None
) -> tuple[Task | None, FieldErrors]:
    """Validate the form and queue the task; on refusal return the errors.

    A bundled example becomes a new code version (added by `user_id`) in the same
    transaction as the task: if the task is refused, neither is stored.
    """
    data, errors = _task_create(project.id, form)
    if data is None:
        return None, errors
    try:
        if form.code_version_id.startswith(EXAMPLE_PREFIX):
            example = form.code_version_id.removeprefix(EXAMPLE_PREFIX)
            version = projects.add_example_version(
                session, project=project, example=example, commit=False, uploaded_by_id=user_id
            )
            data = data.model_copy(update={"code_version_id": version.id})
        return tasks.submit(session, data=data), {}
    except ServiceError as exc:
        session.rollback()
        names = [g.name or "" for g in data.resource_groups]
        errors = service_errors(exc)
        if "example" in errors:
            errors = {"code_version_id": errors["example"]}
        return None, _to_form_fields(errors, names)
