"""The audit log page (admins): write requests and refusals, newest first, filterable."""

from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from backend.audit import service as audit
from backend.audit.models import AuditOutcome
from backend.audit.schemas import AuditFilter
from backend.auth import service as users
from backend.auth.dependencies import WebUser
from backend.core.dependencies import SessionDep
from backend.core.errors import Forbidden
from backend.web.forms import FieldErrors, validation_errors
from backend.web.templating import render

router = APIRouter(include_in_schema=False)
PAGE = "/admin/audit"
PAGE_SIZE = 50
USER_LIMIT = 500


class AuditFilterForm(BaseModel):
    """The filter form as entered (query parameters, every one a string; empty: any)."""

    actor_user_id: str = ""
    action: str = ""
    object_type: str = ""
    object_id: str = ""
    outcome: str = ""
    status_code: str = ""
    client_address: str = ""
    request_id: str = ""
    since: str = ""
    until: str = ""

    def given(self) -> dict[str, str]:
        return {k: v.strip() for k, v in self.model_dump().items() if v.strip()}


def _offset(raw: str | None) -> int:
    return int(raw) if raw and raw.isdigit() else 0


def _links(form: AuditFilterForm, offset: int, total: int) -> dict[str, str | None]:
    """Query strings of the newer and older pages (None at either end), filters kept."""

    def at(start: int) -> str:
        return "?" + urlencode({**form.given(), "offset": start} if start else form.given())

    return {
        "newer": at(max(0, offset - PAGE_SIZE)) if offset else None,
        "older": at(offset + PAGE_SIZE) if offset + PAGE_SIZE < total else None,
    }


def audit_page(
    session: SessionDep, form: AuditFilterForm, offset: int
) -> tuple[dict[str, Any], int]:
    """What the page shows for the entered filters, and its status (422 if one is invalid)."""
    errors: FieldErrors = {}
    try:
        filters = AuditFilter.model_validate(form.given())
    except ValidationError as exc:
        errors, filters = validation_errors(exc), None
    events = (
        audit.list_events(session, filters=filters, offset=offset, limit=PAGE_SIZE)
        if filters
        else []
    )
    total = audit.count(session, filters=filters) if filters else 0
    accounts = users.list_all(session, limit=USER_LIMIT)
    context = {
        "events": events,
        "total": total,
        "offset": offset,
        "form": form,
        "errors": errors,
        "users": accounts,
        "emails": {account.id: account.email for account in accounts},
        "outcomes": [o.value for o in AuditOutcome],
        **audit.known_values(session),
        **_links(form, offset, total),
    }
    return context, 422 if errors else 200


@router.get(PAGE)
def audit_log(request: Request, session: SessionDep, user: WebUser) -> Response:
    """Write requests to the API and the portal, refusals included (admins only)."""
    if not user.is_admin:
        raise Forbidden("only admins read the audit log")
    params = request.query_params
    form = AuditFilterForm.model_validate(
        {k: params.get(k, "") for k in AuditFilterForm.model_fields}
    )
    context, status = audit_page(session, form, _offset(params.get("offset")))
    return render(request, "audit.html", context, status_code=status)
