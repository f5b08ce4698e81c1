"""The cluster page: resource groups and agents; admins create, edit, drain, disable and
delete groups, and drain, disable and describe agents."""

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Form, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from backend.agents import service as agents
from backend.agents.schemas import AgentUpdate
from backend.auth.dependencies import CsrfCheck, WebUser
from backend.auth.models import User
from backend.core.dependencies import SessionDep
from backend.core.errors import Forbidden, ServiceError
from backend.resource_groups import service as groups
from backend.resource_groups.schemas import ResourceGroupCreate, ResourceGroupUpdate
from backend.web.cluster_views import cluster_page
from backend.web.forms import FieldErrors, service_errors, validation_errors
from backend.web.templating import redirect, render

router = APIRouter(include_in_schema=False)
PAGE = "/resource-groups"


class GroupForm(BaseModel):
    """The create- or edit-group form as entered; labels as `key=value, key=value`."""

    name: str = ""
    device_type: str = "cpu"
    capacity: str = "1"
    description: str = ""
    labels: str = ""
    accepted_models: str | None = None


def parse_models(text: str | None) -> list[str] | None:
    """One device model a line -> the list (None: the form did not send the field)."""
    if text is None:
        return None
    return [line.strip() for line in text.splitlines() if line.strip()]


def parse_labels(text: str) -> dict[str, str]:
    """`zone=a, model=xeon` -> {"zone": "a", "model": "xeon"}. Raises ValueError."""
    labels = {}
    for part in filter(None, (p.strip() for p in text.replace("\n", ",").split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"'{part}' is not key=value")
        labels[key.strip()] = value.strip()
    return labels


def _admin(user: User) -> None:
    if not user.is_admin:
        raise Forbidden("only admins manage resource groups and agents")


def _refused(request: Request, session: SessionDep, status: int, **context: Any) -> Response:
    return render(
        request, "resource_groups.html", cluster_page(session, **context), status_code=status
    )


def _apply(session: SessionDep, action: Callable[[], object]) -> tuple[FieldErrors, int]:
    """Run a service call built from the form; its errors and status if refused."""
    try:
        action()
    except ValidationError as exc:
        return validation_errors(exc), 422
    except ValueError as exc:
        return {"labels": str(exc)}, 422
    except ServiceError as exc:
        session.rollback()
        return service_errors(exc), exc.status
    return {}, 200


@router.get(PAGE)
def cluster(request: Request, session: SessionDep, user: WebUser) -> Response:
    """Resource groups with capacity, use and state; agents with heartbeat age and hardware."""
    return render(request, "resource_groups.html", cluster_page(session))


@router.post(PAGE, dependencies=[CsrfCheck])
def create_group(
    request: Request, session: SessionDep, user: WebUser, form: Annotated[GroupForm, Form()]
) -> Response:
    _admin(user)

    def create() -> None:
        data = ResourceGroupCreate.model_validate(
            {
                "name": form.name.strip(),
                "device_type": form.device_type,
                "capacity": form.capacity,
                "description": form.description,
                "labels": parse_labels(form.labels),
            }
        )
        groups.create(session, data=data)

    errors, status = _apply(session, create)
    if errors:
        return _refused(request, session, status, form=form.model_dump(), errors=errors)
    return redirect(PAGE, flash=f"Resource group '{form.name.strip()}' created.")


@router.post(PAGE + "/{name}/edit", dependencies=[CsrfCheck])
def edit_group(
    request: Request,
    name: str,
    session: SessionDep,
    user: WebUser,
    form: Annotated[GroupForm, Form()],
) -> Response:
    """Change a group's capacity, description, labels and accepted device models."""
    _admin(user)
    group = groups.get_by_name(session, name=name)

    def update() -> None:
        data = ResourceGroupUpdate.model_validate(
            {
                "capacity": form.capacity,
                "description": form.description,
                "labels": parse_labels(form.labels),
                "accepted_models": parse_models(form.accepted_models),
            }
        )
        groups.update(session, group=group, data=data)

    errors, status = _apply(session, update)
    if errors:
        return _refused(request, session, status, row_errors={name: errors})
    return redirect(PAGE, flash=f"Resource group '{name}' updated.")


@router.post(PAGE + "/{name}/state", dependencies=[CsrfCheck])
def set_state(
    request: Request,
    name: str,
    session: SessionDep,
    user: WebUser,
    state: Annotated[str, Form()] = "",
) -> Response:
    """Drain (finish running tasks, take no new ones), disable, or re-activate a group."""
    _admin(user)
    group = groups.get_by_name(session, name=name)
    errors, status = _apply(
        session,
        lambda: groups.update(
            session,
            group=group,
            data=ResourceGroupUpdate(state=state),  # type: ignore[arg-type]
        ),
    )
    if errors:
        return _refused(request, session, status, row_errors={name: errors})
    return redirect(PAGE, flash=f"Resource group '{name}' is now {state}.")


@router.post(PAGE + "/{name}/delete", dependencies=[CsrfCheck])
def delete_group(request: Request, name: str, session: SessionDep, user: WebUser) -> Response:
    _admin(user)
    group = groups.get_by_name(session, name=name)
    errors, status = _apply(session, lambda: groups.delete(session, group=group))
    if errors:
        return _refused(request, session, status, row_errors={name: errors})
    return redirect(PAGE, flash=f"Resource group '{name}' deleted.")


def _update_agent(
    request: Request,
    session: SessionDep,
    user: User,
    agent_id: int,
    changes: dict[str, str],
    done: str,
) -> Response:
    """Apply an admin's change to an agent; the page with the error next to it if refused."""
    _admin(user)
    agent = agents.get(session, agent_id=agent_id)
    errors, status = _apply(
        session,
        lambda: agents.update(session, agent=agent, data=AgentUpdate.model_validate(changes)),
    )
    if errors:
        return _refused(request, session, status, agent_errors={agent.id: errors})
    return redirect(PAGE, flash=f"Agent '{agent.name}' {done}.")


@router.post(PAGE + "/agents/{agent_id}/state", dependencies=[CsrfCheck])
def set_agent_state(
    request: Request,
    agent_id: int,
    session: SessionDep,
    user: WebUser,
    state: Annotated[str, Form()] = "",
) -> Response:
    """Drain (finish what it runs, claim nothing new), disable, or re-activate an agent."""
    return _update_agent(request, session, user, agent_id, {"state": state}, f"is now {state}")


@router.post(PAGE + "/agents/{agent_id}/edit", dependencies=[CsrfCheck])
def edit_agent(
    request: Request,
    agent_id: int,
    session: SessionDep,
    user: WebUser,
    description: Annotated[str, Form()] = "",
) -> Response:
    """Change an agent's description (a note for the other admins)."""
    return _update_agent(request, session, user, agent_id, {"description": description}, "updated")
