"""Portal pages of accounts: log in and out, one's own account and tokens, users (admins)."""

from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Form, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from backend.auth import security, tokens
from backend.auth import service as users
from backend.auth.dependencies import SESSION_COOKIE, CsrfCheck, WebUser
from backend.auth.models import User
from backend.auth.throttle import client_address
from backend.core.config import get_settings
from backend.core.dependencies import SessionDep
from backend.core.errors import Forbidden
from backend.web import account_forms as forms
from backend.web.account_forms import LoginForm, PasswordForm, TokenForm, UserEditForm, UserForm
from backend.web.templating import redirect, render

router = APIRouter(include_in_schema=False)
LOGIN_CSRF_COOKIE = "polytrain_login_csrf"


def next_query(next_url: str) -> str:
    return urlencode({"next": next_url})


def _safe_next(url: str) -> str:
    """Only a path on this site: never an open redirect to another host."""
    return url if url.startswith("/") and not url.startswith(("//", "/\\")) else "/"


def secure_cookies(request: Request) -> bool:
    """Whether cookies get the Secure flag: over HTTPS, or always with `cookie_secure`."""
    return get_settings().cookie_secure or request.url.scheme == "https"


def _login_page(
    request: Request,
    form: LoginForm,
    errors: dict,
    status_code: int,
    headers: dict[str, str] | None = None,
) -> Response:
    token = security.new_secret()
    context = {"form": form.model_copy(update={"csrf_token": token}), "errors": errors}
    response = render(request, "login.html", context, status_code=status_code)
    response.headers.update(headers or {})
    response.set_cookie(
        LOGIN_CSRF_COOKIE,
        token,
        httponly=True,
        samesite="strict",
        path="/login",
        secure=secure_cookies(request),
    )
    if status_code == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="polytrain"'
    return response


@router.get("/login")
def login_page(request: Request, next: str = "/") -> Response:
    """The login form (a logged-out page)."""
    return _login_page(request, LoginForm(next=_safe_next(next)), {}, 200)


@router.post("/login")
async def login(
    request: Request, session: SessionDep, form: Annotated[LoginForm, Form()]
) -> Response:
    """Check the password (rate limited, bounded hashing: see `backend.auth.throttle`),
    start a session (HttpOnly cookie) and go where the user was going."""
    expected = request.cookies.get(LOGIN_CSRF_COOKIE, "")
    if not expected or not security.same(form.csrf_token, expected):
        errors = {"__all__": "the login form expired; please try again"}
        return _login_page(request, form.model_copy(update={"password": ""}), errors, 403)
    state = request.app.state
    user, errors, status, headers = await forms.login(
        session,
        form,
        limiter=state.login_limiter,
        gate=state.hash_gate,
        address=client_address(request),
    )
    if user is None:
        return _login_page(
            request, form.model_copy(update={"password": ""}), errors, status, headers
        )
    request.state.user = user  # the audit log's actor of this login
    _, cookie = await run_in_threadpool(lambda: tokens.start_session(session, user=user))
    response = redirect(_safe_next(form.next))
    response.set_cookie(
        SESSION_COOKIE,
        cookie,
        httponly=True,
        samesite="lax",
        path="/",
        max_age=tokens.SESSION_DAYS * 86400,
        secure=secure_cookies(request),
    )
    response.delete_cookie(LOGIN_CSRF_COOKIE, path="/login")
    return response


@router.post("/logout", dependencies=[CsrfCheck])
def logout(request: Request, session: SessionDep, user: WebUser) -> Response:
    """End this browser's session."""
    tokens.end_session(session, cookie=request.cookies.get(SESSION_COOKIE, ""))
    response = redirect("/login", flash="Logged out.")
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


def _account(
    request: Request, session: SessionDep, user: User, *, status_code: int = 200, **context: Any
) -> Response:
    base = {
        "tokens": tokens.list_for(session, user=user),
        "token_form": TokenForm(),
        "password_form": PasswordForm(),
        "errors": {},
        "new_token": None,
    }
    return render(request, "account.html", {**base, **context}, status_code=status_code)


@router.get("/account")
def account(request: Request, session: SessionDep, user: WebUser) -> Response:
    """One's own account: password and personal API tokens."""
    return _account(request, session, user)


@router.post("/account/password", dependencies=[CsrfCheck])
async def change_password(
    request: Request, session: SessionDep, user: WebUser, form: Annotated[PasswordForm, Form()]
) -> Response:
    keep = tokens.Credential(session_cookie=request.cookies.get(SESSION_COOKIE))
    state = request.app.state
    errors, status = await forms.change_password(
        session,
        user,
        form,
        limiter=state.login_limiter,
        gate=state.hash_gate,
        address=client_address(request),
        keep=keep,
    )
    if errors:
        return await run_in_threadpool(
            _account, request, session, user, errors=errors, status_code=status
        )
    return redirect("/account", flash="Password changed.")


@router.post("/account/tokens", dependencies=[CsrfCheck])
def create_token(
    request: Request, session: SessionDep, user: WebUser, form: Annotated[TokenForm, Form()]
) -> Response:
    """Create a token and show its secret on this page, once."""
    created, errors = forms.create_token(session, user, form)
    if created is None:
        return _account(request, session, user, errors=errors, token_form=form, status_code=422)
    return _account(request, session, user, new_token=created[1], status_code=201)


@router.post("/account/tokens/{token_id}/revoke", dependencies=[CsrfCheck])
def revoke_token(token_id: int, session: SessionDep, user: WebUser) -> Response:
    token = tokens.revoke(session, user=user, token_id=token_id)
    return redirect("/account", flash=f"Token '{token.name}' revoked.")


def _users(
    request: Request, session: SessionDep, *, status_code: int = 200, **context: Any
) -> Response:
    base = {
        "users": users.list_all(session, limit=500),
        "form": UserForm(),
        "errors": {},
        "row_errors": {},
    }
    return render(request, "users.html", {**base, **context}, status_code=status_code)


def _admin(user: User) -> None:
    if not user.is_admin:
        raise Forbidden("only admins manage users")


@router.get("/admin/users")
def user_list(request: Request, session: SessionDep, user: WebUser) -> Response:
    """Every account, and forms to add and change them (admins)."""
    _admin(user)
    return _users(request, session)


@router.post("/admin/users", dependencies=[CsrfCheck])
def create_user(
    request: Request, session: SessionDep, user: WebUser, form: Annotated[UserForm, Form()]
) -> Response:
    _admin(user)
    created, errors = forms.create_user(session, form)
    if created is None:
        status = 409 if "already exists" in errors.get("email", "") else 422
        return _users(
            request,
            session,
            form=form.model_copy(update={"password": ""}),
            errors=errors,
            status_code=status,
        )
    return redirect("/admin/users", flash=f"User {created.email} created.")


@router.post("/admin/users/{user_id}", dependencies=[CsrfCheck])
def update_user(
    request: Request,
    user_id: int,
    session: SessionDep,
    user: WebUser,
    form: Annotated[UserEditForm, Form()],
) -> Response:
    _admin(user)
    target = users.get(session, user_id=user_id)
    keep = tokens.Credential(session_cookie=request.cookies.get(SESSION_COOKIE))
    errors = forms.update_user(session, target, user, form, keep)
    if errors:
        return _users(
            request,
            session,
            row_errors={user_id: next(iter(errors.values()))},
            status_code=409 if "own account" in str(errors) else 422,
        )
    return redirect("/admin/users", flash=f"User {target.email} updated.")
