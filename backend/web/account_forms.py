"""Forms of accounts: log in, change password, personal API tokens, users (admins)."""

from pydantic import BaseModel, ValidationError
from sqlalchemy.orm import Session

from backend.auth import service as users
from backend.auth import tokens
from backend.auth.models import ApiToken, User, UserRole
from backend.auth.schemas import PasswordChange, TokenCreate, UserCreate, UserUpdate
from backend.auth.throttle import HashGate, LoginLimiter
from backend.core.errors import ServiceError
from backend.web.forms import FieldErrors, service_errors, validation_errors


class LoginForm(BaseModel):
    email: str = ""
    password: str = ""
    next: str = "/"
    csrf_token: str = ""


class PasswordForm(BaseModel):
    current_password: str = ""
    new_password: str = ""
    confirm_password: str = ""


class TokenForm(BaseModel):
    name: str = ""
    expires_in_days: str = "90"


class UserForm(BaseModel):
    """The create-user form (admins)."""

    email: str = ""
    name: str = ""
    password: str = ""
    role: str = UserRole.MEMBER.value


class UserEditForm(BaseModel):
    """One row of the users table (admins): role, active, optional new password."""

    role: str = ""
    is_active: str = ""
    password: str = ""


async def login(
    session: Session, form: LoginForm, *, limiter: LoginLimiter, gate: HashGate, address: str
) -> tuple[User | None, FieldErrors, int, dict[str, str]]:
    """The user for these credentials, or the errors, the HTTP status and the headers
    (`Retry-After` when rate limited or busy) to show them with."""
    if not form.email.strip() or not form.password:
        missing = {k: "required" for k in ("email", "password") if not getattr(form, k).strip()}
        return None, missing, 422, {}
    try:
        await limiter.check(email=form.email, address=address)
        user = await users.authenticate(
            session, email=form.email, password=form.password, gate=gate
        )
        return user, {}, 200, {}
    except ServiceError as exc:
        return None, service_errors(exc), exc.status, dict(exc.headers or {})


async def change_password(
    session: Session,
    user: User,
    form: PasswordForm,
    *,
    limiter: LoginLimiter,
    gate: HashGate,
    address: str,
    keep: tokens.Credential | None = None,
) -> tuple[FieldErrors, int]:
    """Set the new password (ending every other session and token but `keep`), or return
    why not and the HTTP status to say it with; limited and gated as a login is."""
    if form.new_password != form.confirm_password:
        return {"confirm_password": "the two new passwords differ"}, 422
    try:
        await limiter.check(email=user.email, address=address)
        data = PasswordChange(
            current_password=form.current_password, new_password=form.new_password
        )
        await users.change_password(
            session,
            user=user,
            current=data.current_password,
            new=data.new_password,
            gate=gate,
            keep=keep,
        )
    except ValidationError as exc:
        return validation_errors(exc), 422
    except ServiceError as exc:
        return service_errors(exc), exc.status
    return {}, 200


def create_token(
    session: Session, user: User, form: TokenForm
) -> tuple[tuple[ApiToken, str] | None, FieldErrors]:
    """A new token and its secret (to show once), or the errors."""
    try:
        days = form.expires_in_days.strip()
        data = TokenCreate(name=form.name.strip(), expires_in_days=int(days) if days else None)
    except ValueError as exc:  # int() or pydantic's ValidationError (a ValueError)
        if isinstance(exc, ValidationError):
            return None, validation_errors(exc)
        return None, {"expires_in_days": "enter a whole number of days, or leave it empty"}
    try:
        return tokens.issue(
            session, user=user, name=data.name, expires_in_days=data.expires_in_days
        ), {}
    except ServiceError as exc:  # the per-user cap
        session.rollback()
        return None, service_errors(exc)


def create_user(session: Session, form: UserForm) -> tuple[User | None, FieldErrors]:
    try:
        data = UserCreate(
            email=form.email.strip(),
            name=form.name.strip(),
            password=form.password,
            role=form.role,  # type: ignore[arg-type]
        )
        return users.create(session, data=data), {}
    except ValidationError as exc:
        return None, validation_errors(exc)
    except ServiceError as exc:
        session.rollback()
        return None, service_errors(exc)


def update_user(
    session: Session,
    target: User,
    acting: User,
    form: UserEditForm,
    keep: tokens.Credential | None = None,
) -> FieldErrors:
    """Apply an admin's row edit; an empty password leaves the password alone (a new one
    ends the user's sessions and tokens, but `keep`, the acting admin's own), an empty role
    or active choice leaves that alone. A choice not offered is refused by name."""
    if form.is_active not in ("", "true", "false"):
        return {"is_active": "is_active must be true or false"}
    try:
        data = UserUpdate(
            role=form.role or None,  # type: ignore[arg-type]
            is_active=form.is_active == "true" if form.is_active else None,
            password=form.password or None,
        )
        users.update(session, user=target, data=data, acting=acting, keep=keep)
    except ValidationError as exc:
        return validation_errors(exc)
    except ServiceError as exc:
        session.rollback()
        return service_errors(exc)
    return {}
