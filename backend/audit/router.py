"""REST for the audit log: `GET /api/v1/audit` (admins only)."""

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response

from backend.audit import service
from backend.audit.models import AuditEvent
from backend.audit.schemas import AuditEventRead, AuditFilter
from backend.auth.dependencies import require_admin
from backend.core.dependencies import SessionDep
from backend.core.pagination import TOTAL_HEADER, Page

router = APIRouter(prefix="/audit", tags=["audit"], dependencies=[Depends(require_admin)])


@router.get("", response_model=list[AuditEventRead])
def list_audit_events(
    session: SessionDep, filters: Annotated[AuditFilter, Query()], page: Page, response: Response
) -> list[AuditEvent]:
    """Write requests to the API and the portal, and refused requests, newest first.

    Every given filter must match; the total goes in `X-Total-Count`. Admins only (403 for
    members).
    """
    response.headers[TOTAL_HEADER] = str(service.count(session, filters=filters))
    return list(service.list_events(session, filters=filters, offset=page.offset, limit=page.limit))
