"""Credentials after login: personal API tokens (REST, CLI) and web sessions (portal)."""

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from backend.auth import security
from backend.auth.models import ApiToken, User, WebSession
from backend.core.config import get_settings
from backend.core.db import utcnow
from backend.core.errors import Conflict, NotFound, Unauthorized

SESSION_DAYS = 7
PREFIX_CHARS = 9


@dataclass(frozen=True)
class Credential:
    """The secret a request came with (an API token or a session cookie, plain): the one
    credential kept when a password change ends all the others."""

    api_token: str | None = None
    session_cookie: str | None = None


def _live(user_id: int):  # type: ignore[no-untyped-def]
    now = utcnow()
    return (
        ApiToken.user_id == user_id,
        ApiToken.revoked_at.is_(None),
        or_(ApiToken.expires_at.is_(None), ApiToken.expires_at > now),
    )


def _make_room(session: Session, *, user: User, rotate: bool) -> None:
    """Keep the user's live tokens under the cap: revoke the oldest (rotate) or refuse."""
    cap = get_settings().token_cap_per_user
    live = session.scalars(select(ApiToken).where(*_live(user.id)).order_by(ApiToken.id)).all()
    if len(live) < cap:
        return
    if not rotate:
        raise Conflict(
            f"you have {len(live)} live API tokens, the most allowed; revoke one first",
            field="name",
        )
    for token in live[: len(live) - cap + 1]:
        token.revoked_at = utcnow()


def issue(
    session: Session, *, user: User, name: str, expires_in_days: int | None, rotate: bool = False
) -> tuple[ApiToken, str]:
    """Create a token for `user`; returns the row and the token itself (shown once).

    `expires_in_days` None means the default expiry (`token_default_expiry_days`): every
    token expires. A user holds at most `token_cap_per_user` live tokens: past it the
    oldest are revoked (`rotate`, what a password login does) or the new one is refused.

    Raises:
        Conflict: the cap is reached and `rotate` is false.
    """
    _make_room(session, user=user, rotate=rotate)
    plain = security.new_api_token()
    days = expires_in_days or get_settings().token_default_expiry_days
    token = ApiToken(
        user_id=user.id,
        name=name,
        token_hash=security.digest(plain),
        prefix=plain[:PREFIX_CHARS],
        expires_at=utcnow() + timedelta(days=days),
    )
    session.add(token)
    session.commit()
    return token, plain


def revoke_all(session: Session, *, user: User, keep: Credential | None = None) -> None:
    """Revoke every API token and browser session of `user` but `keep`'s (not committed)."""
    keep = keep or Credential()
    now = utcnow()
    tokens = update(ApiToken).where(ApiToken.user_id == user.id, ApiToken.revoked_at.is_(None))
    if keep.api_token:
        tokens = tokens.where(ApiToken.token_hash != security.digest(keep.api_token))
    sessions = update(WebSession).where(
        WebSession.user_id == user.id, WebSession.revoked_at.is_(None)
    )
    if keep.session_cookie:
        sessions = sessions.where(WebSession.token_hash != security.digest(keep.session_cookie))
    session.execute(tokens.values(revoked_at=now))
    session.execute(sessions.values(revoked_at=now))


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
        raise Unauthorized(
            f"API token '{token.name}' expired at {token.expires_at:%Y-%m-%d %H:%M} "
            "UTC; log in again"
        )
    user = session.get_one(User, token.user_id)
    if not user.is_active:
        raise Unauthorized("this account is disabled")
    if token.last_used_at is None or now - token.last_used_at > timedelta(minutes=1):
        token.last_used_at = now  # at most once a minute: reads stay reads
        session.commit()
    return token, user


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
    web = WebSession(
        user_id=user.id,
        token_hash=security.digest(cookie),
        csrf_token=security.new_secret(),
        expires_at=utcnow() + timedelta(days=SESSION_DAYS),
    )
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
