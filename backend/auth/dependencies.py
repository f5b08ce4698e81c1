"""Who is calling: typed FastAPI dependencies for users, portal sessions and agents.

REST callers authenticate with a personal API token (`Authorization: Bearer pt_...`)
or, from the portal's own scripts, with the session cookie; a cookie-authenticated
request that changes something must also carry the session's CSRF token in the
`X-CSRF-Token` header. Portal pages use the session cookie and a `csrf_token`
form field. Agents use the shared agent token on /internal/v1 only.

What a known caller may see and change is decided next to each domain
(`backend/projects/access.py`, `backend/tasks/access.py`; docs/architecture.md, Access).
"""

from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from backend.auth import tokens
from backend.auth.models import User, WebSession
from backend.auth.security import same
from backend.core.dependencies import SessionDep, SettingsDep
from backend.core.errors import Forbidden, Unauthorized

SESSION_COOKIE = "polytrain_session"
CSRF_HEADER = "X-CSRF-Token"
CSRF_FIELD = "csrf_token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOGIN_HINT = (
    "log in: send 'Authorization: Bearer <token>' (a personal API token from "
    "`polytrain login` or the portal's Account page)"
)

bearer_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="APIToken",
    description="A personal API token (`pt_...`), from `POST /api/v1/auth/login`, "
    "`polytrain login` or the portal's Account page.",
)


async def require_agent_token(
    settings: SettingsDep, authorization: Annotated[str | None, Header()] = None
) -> None:
    """Check the `Authorization: Bearer <agent token>` header of the internal API (on the
    event loop: a string comparison needs no worker thread).

    Raises:
        Unauthorized: the header is missing or carries another token.
    """
    expected = settings.agent_token.get_secret_value()
    if not same(authorization or "", f"Bearer {expected}"):
        raise Unauthorized("missing or wrong agent token (Authorization: Bearer <token>)")


AgentAuth = Depends(require_agent_token)


def _web_session(request: Request, session: Session) -> tuple[WebSession, User] | None:
    cookie = request.cookies.get(SESSION_COOKIE)
    return tokens.resolve_session(session, cookie=cookie) if cookie else None


def current_user(
    request: Request,
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> User:
    """The caller of a REST endpoint, by API token or by portal session cookie.

    Raises:
        Unauthorized: no credentials, or an unknown, revoked or expired token.
        Forbidden: a cookie-authenticated change without the session's CSRF token.
    """
    if credentials is not None:
        token, user = tokens.authenticate(session, plain=credentials.credentials)
        request.state.user, request.state.api_token_id = user, token.id  # the audit's actor
    else:
        resolved = _web_session(request, session)
        if resolved is None:
            raise Unauthorized(LOGIN_HINT)
        web, user = resolved
        request.state.user = user  # known before the CSRF check: a refusal names its actor
        sent = request.headers.get(CSRF_HEADER, "")
        if request.method not in SAFE_METHODS and not same(sent, web.csrf_token):
            raise Forbidden(f"missing or wrong CSRF token (send the {CSRF_HEADER} header)")
    return user


CurrentUser = Annotated[User, Depends(current_user)]
UserAuth = Depends(current_user)


def caller_credential(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> tokens.Credential:
    """The API token or session cookie this request authenticated with (as `current_user`
    picks it: the bearer token first)."""
    if credentials is not None:
        return tokens.Credential(api_token=credentials.credentials)
    return tokens.Credential(session_cookie=request.cookies.get(SESSION_COOKIE))


CallerCredential = Annotated[tokens.Credential, Depends(caller_credential)]


def require_admin(user: CurrentUser) -> User:
    """The caller, who must be an admin. Raises Forbidden."""
    if not user.is_admin:
        raise Forbidden("only admins may do this")
    return user


AdminUser = Annotated[User, Depends(require_admin)]


def admin_for_writes(request: Request, user: CurrentUser) -> User:
    """Any user may read; only an admin may change (for cluster resources). Raises Forbidden."""
    if request.method not in SAFE_METHODS and not user.is_admin:
        raise Forbidden("only admins manage resource groups and agents")
    return user


AdminWrites = Depends(admin_for_writes)


class LoginRequired(Exception):
    """A portal page was asked for without a live session: the user is sent to log in."""

    def __init__(self, next_url: str) -> None:
        super().__init__(next_url)
        self.next_url = next_url


def web_user(request: Request, session: SessionDep) -> User:
    """The logged-in user of a portal page; keeps the session's CSRF token for the forms.

    Raises:
        LoginRequired: no live session (answered with a redirect to /login).
    """
    resolved = _web_session(request, session)
    if resolved is None:
        query = f"?{request.url.query}" if request.url.query else ""
        raise LoginRequired(request.url.path + query)
    web, user = resolved
    request.state.user, request.state.csrf_token = user, web.csrf_token
    return user


WebUser = Annotated[User, Depends(web_user)]


async def check_csrf(request: Request, user: WebUser) -> None:
    """Refuse a portal form that changes something without the session's CSRF token.

    Raises:
        Forbidden: the `csrf_token` field (or `X-CSRF-Token` header) is missing or wrong.
    """
    if request.method in SAFE_METHODS:
        return
    form = await request.form()
    sent = form.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER) or ""
    if not isinstance(sent, str) or not same(sent, request.state.csrf_token):
        raise Forbidden(
            "this form has expired or did not come from the portal (CSRF check); "
            "reload the page and try again"
        )


CsrfCheck = Depends(check_csrf)
