"""Record audit events and list them, newest first."""

from collections.abc import Sequence

from sqlalchemy import ColumnElement, Select, func, select
from sqlalchemy.orm import Session

from backend.audit.models import AuditEvent
from backend.audit.schemas import AuditEventCreate, AuditFilter


def record(session: Session, *, data: AuditEventCreate) -> AuditEvent:
    """Append one event and commit it."""
    event = AuditEvent(**data.model_dump())
    session.add(event)
    session.commit()
    return event


def _conditions(filters: AuditFilter) -> list[ColumnElement[bool]]:
    exact = {
        "actor_user_id": AuditEvent.actor_user_id,
        "actor_token_id": AuditEvent.actor_token_id,
        "object_type": AuditEvent.object_type,
        "object_id": AuditEvent.object_id,
        "outcome": AuditEvent.outcome,
        "status_code": AuditEvent.status_code,
        "client_address": AuditEvent.client_address,
        "request_id": AuditEvent.request_id,
    }
    given = filters.model_dump(exclude_none=True)
    conditions = [column == given[name] for name, column in exact.items() if name in given]
    if filters.action is not None:
        if filters.action.endswith("*"):
            prefix = filters.action.removesuffix("*")
            conditions.append(AuditEvent.action.startswith(prefix, autoescape=True))
        else:
            conditions.append(AuditEvent.action == filters.action)
    if filters.since is not None:
        conditions.append(AuditEvent.at >= filters.since)
    if filters.until is not None:
        conditions.append(AuditEvent.at < filters.until)
    return conditions


def _filtered(query: Select, filters: AuditFilter) -> Select:  # type: ignore[type-arg]
    return query.where(*_conditions(filters))


def count(session: Session, *, filters: AuditFilter) -> int:
    """How many events match `filters`."""
    return session.scalar(_filtered(select(func.count(AuditEvent.id)), filters)) or 0


def list_events(
    session: Session, *, filters: AuditFilter, offset: int = 0, limit: int = 100
) -> Sequence[AuditEvent]:
    """The events matching `filters`, newest first, `limit` of them after skipping `offset`."""
    query = _filtered(select(AuditEvent), filters).order_by(AuditEvent.id.desc())
    return session.scalars(query.offset(offset).limit(limit)).all()


def known_values(session: Session) -> dict[str, list[str]]:
    """The actions and object types recorded so far (the choices of the portal's filters)."""
    return {
        "actions": list(
            session.scalars(select(AuditEvent.action).distinct().order_by(AuditEvent.action))
        ),
        "object_types": [
            t
            for t in session.scalars(
                select(AuditEvent.object_type).distinct().order_by(AuditEvent.object_type)
            )
            if t
        ],
    }
