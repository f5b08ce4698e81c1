"""Accounts: creation, password login, admin changes, the first admin."""

from collections.abc import Sequence

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from backend.auth import security, tokens
from backend.auth.models import User, UserRole
from backend.auth.schemas import UserCreate, UserUpdate
from backend.auth.throttle import HashGate
from backend.core.db import utcnow
from backend.core.errors import Conflict, Forbidden, NotFound, Unauthorized

WRONG_CREDENTIALS = "wrong email or password"


def get_by_email(session: Session, *, email: str) -> User | None:
    return session.scalar(select(User).where(User.email == email.strip().lower()))


def get(session: Session, *, user_id: int) -> User:
    """The user `user_id`. Raises NotFound."""
    user = session.get(User, user_id)
    if user is None:
        raise NotFound(f"user {user_id} does not exist", field="user_id")
    return user


def create(session: Session, *, data: UserCreate) -> User:
    """Create an account. Raises Conflict if the email is taken."""
    if get_by_email(session, email=data.email):
        raise Conflict(f"a user with email '{data.email}' already exists", field="email")
    user = User(
        email=data.email,
        name=data.name,
        role=data.role,
        password_hash=security.hash_password(data.password),
    )
    session.add(user)
    session.commit()
    return user


async def authenticate(session: Session, *, email: str, password: str, gate: HashGate) -> User:
    """The active user with this email and password; records the login time.

    The password is verified through `gate` (bounded concurrent hashing); database work
    runs in the threadpool, so the event loop never blocks.

    Raises:
        Unauthorized: unknown email or wrong password (one message for both).
        Forbidden: the account is disabled.
        Busy: too many hashes running and waiting (503).
    """
    user = await run_in_threadpool(get_by_email, session, email=email)
    stored = user.password_hash if user else None
    if not await gate.run(security.verify_password, stored, password):
        raise Unauthorized(WRONG_CREDENTIALS, field="password")
    assert user is not None
    if not user.is_active:
        raise Forbidden("this account is disabled; ask an admin", field="email")
    if security.needs_rehash(user.password_hash):
        user.password_hash = await gate.run(security.hash_password, password)
    user.last_login_at = utcnow()
    await run_in_threadpool(session.commit)
    return user


def list_all(session: Session, *, offset: int = 0, limit: int = 100) -> Sequence[User]:
    return session.scalars(select(User).order_by(User.id).offset(offset).limit(limit)).all()


def count(session: Session) -> int:
    return session.scalar(select(func.count(User.id))) or 0


def update(
    session: Session,
    *,
    user: User,
    data: UserUpdate,
    acting: User,
    keep: tokens.Credential | None = None,
) -> User:
    """Apply an admin's changes. An admin cannot demote or disable themself (Conflict),
    so the platform never loses its last way in. A password reset ends every session and
    API token of the user (but `keep`, the acting admin's own credential, when an admin
    resets their own password)."""
    changes = data.model_dump(exclude_unset=True, exclude_none=True)
    if user.id == acting.id and (
        changes.get("role") == UserRole.MEMBER or changes.get("is_active") is False
    ):
        raise Conflict("you cannot demote or disable your own account", field="role")
    if "password" in changes:
        user.password_hash = security.hash_password(changes.pop("password"))
        # A reset password means the old one may be known: every credential made with it ends.
        tokens.revoke_all(session, user=user, keep=keep if user.id == acting.id else None)
    for key, value in changes.items():
        setattr(user, key, value)
    session.commit()
    return user


async def change_password(
    session: Session,
    *,
    user: User,
    current: str,
    new: str,
    gate: HashGate,
    keep: tokens.Credential | None = None,
) -> None:
    """Set a new password after checking the current one, and end every other session and
    API token of the user (`keep`: the credential this change was made with). Both hashes
    go through `gate`, as a login's do; the caller rate-limits the attempt.

    Raises:
        Unauthorized: the current password is wrong.
        Busy: too many hashes running and waiting (503).
    """
    if not await gate.run(security.verify_password, user.password_hash, current):
        raise Unauthorized("the current password is wrong", field="current_password")
    user.password_hash = await gate.run(security.hash_password, new)

    def revoke_others() -> None:
        tokens.revoke_all(session, user=user, keep=keep)
        session.commit()

    await run_in_threadpool(revoke_others)


def ensure_admin(session: Session, *, email: str, password: str) -> tuple[User, bool]:
    """The admin `email`, created with `password` unless it exists; (user, created).

    An existing account with that email is made an active admin; its password is
    left alone (the settings only seed the first login).
    """
    user = get_by_email(session, email=email)
    if user is None:
        try:
            user = create(
                session,
                data=UserCreate(email=email, password=password, name="admin", role=UserRole.ADMIN),
            )
        except (Conflict, IntegrityError):  # another API process created it just now
            session.rollback()
            user = get_by_email(session, email=email)
            assert user is not None
            return user, False
        return user, True
    user.role, user.is_active = UserRole.ADMIN, True
    session.commit()
    return user, False
