"""Credentials after login: personal API tokens (REST, CLI) and web sessions (portal)."""

from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.auth import security
from backend.auth.models import ApiToken, User, WebSession
from backend.core.db import utcnow
from backend.core.errors import NotFound, Unauthorized

SESSION_DAYS = 7
PREFIX_CHARS = 9


def issue(session: Session, *, user: User, name: str, expires_in_days: int | None
          ) -> tuple[ApiToken, str]:
    """Create a token for `user`; returns the row and the token itself (shown once)."""
    plain = security.new_api_token()
    expires = utcnow() + timedelta(days=expires_in_days) if expires_in_days else None
    token = ApiToken(user_id=user.id, name=name, token_hash=security.digest(plain),
                     prefix=plain[:PREFIX_CHARS], expires_at=expires)
    session.add(token)
    session.commit()
    return token, plain


def authenticate(session: Session, *, plain: str) -> tuple[ApiToken, User]:
    """The bearer token `plain` and its active user; stamps the token's last use.

    Raises:
        Unauthorized: unknown, revoked or expired token, or a disabled user (each said).
    """
    token = session.scalar(select(ApiToken).where(ApiToken.token_hash == security.digest(plain)))
    if token is None:
        raise Unauthorized("invalid API token")
    if token.revoked_at is not None:
        raise Unauthorized(f"API token '{token.name}' was revoked")
    now = utcnow()
    if token.expires_at is not None and token.expires_at <= now:
        raise Unauthorized(f"API token '{token.name}' expired at {token.expires_at:%Y-%m-%d %H:%M} "
                           "UTC; log in again")
    user = session.get_one(User, token.user_id)
    if not user.is_active:
        raise Unauthorized("this account is disabled")
    if token.last_used_at is None or now - token.last_used_at > timedelta(minutes=1):
        token.last_used_at = now  # at most once a minute: reads stay reads
        session.commit()
    return token, user


def user_for_token(session: Session, *, plain: str) -> User:
    """The active user a bearer token belongs to (see `authenticate`). Raises Unauthorized."""
    return authenticate(session, plain=plain)[1]


def list_for(session: Session, *, user: User) -> Sequence[ApiToken]:
    query = select(ApiToken).where(ApiToken.user_id == user.id).order_by(ApiToken.id.desc())
    return session.scalars(query).all()


def revoke(session: Session, *, user: User, token_id: int) -> ApiToken:
    """Revoke one of `user`'s tokens (idempotent). Raises NotFound for anyone else's."""
    token = session.get(ApiToken, token_id)
    if token is None or token.user_id != user.id:
        raise NotFound(f"token {token_id} does not exist", field="token_id")
    if token.revoked_at is None:
        token.revoked_at = utcnow()
        session.commit()
    return token


def start_session(session: Session, *, user: User) -> tuple[WebSession, str]:
    """A new browser session; returns the row and the cookie value."""
    cookie = security.new_secret()
    web = WebSession(user_id=user.id, token_hash=security.digest(cookie),
                     csrf_token=security.new_secret(),
                     expires_at=utcnow() + timedelta(days=SESSION_DAYS))
    session.add(web)
    session.commit()
    return web, cookie


def resolve_session(session: Session, *, cookie: str) -> tuple[WebSession, User] | None:
    """The live session of a cookie and its active user, or None."""
    web = session.scalar(select(WebSession).where(WebSession.token_hash == security.digest(cookie)))
    if web is None or web.revoked_at is not None or web.expires_at <= utcnow():
        return None
    user = session.get_one(User, web.user_id)
    return (web, user) if user.is_active else None


def end_session(session: Session, *, cookie: str) -> None:
    """Log a browser out: its session stops working at once."""
    resolved = resolve_session(session, cookie=cookie)
    if resolved:
        resolved[0].revoked_at = utcnow()
        session.commit()


def revoke_plain(session: Session, *, plain: str) -> None:
    """Revoke the token `plain` itself (logging a CLI out); unknown tokens are ignored."""
    token = session.scalar(select(ApiToken).where(ApiToken.token_hash == security.digest(plain)))
    if token is not None and token.revoked_at is None:
        token.revoked_at = utcnow()
        session.commit()
