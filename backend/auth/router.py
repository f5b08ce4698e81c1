"""REST for accounts: log in for a token, one's own account and tokens, users (admins)."""

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials

from backend.auth import service, tokens
from backend.auth.dependencies import AdminUser, CallerCredential, CurrentUser, bearer_scheme
from backend.auth.models import ApiToken, User
from backend.auth.schemas import (
    LoginRequest,
    PasswordChange,
    TokenCreate,
    TokenCreated,
    TokenRead,
    UserCreate,
    UserRead,
    UserUpdate,
)
from backend.auth.throttle import client_address
from backend.core.dependencies import SessionDep
from backend.core.errors import ErrorResponse
from backend.core.pagination import Page, paginated

auth_router = APIRouter(prefix="/auth", tags=["auth"])
users_router = APIRouter(prefix="/users", tags=["users"])


def _created(token: ApiToken, plain: str, user: User) -> TokenCreated:
    return TokenCreated.model_validate(
        {
            **TokenRead.model_validate(token).model_dump(),
            "token": plain,
            "user": UserRead.model_validate(user),
        }
    )


@auth_router.post(
    "/login",
    response_model=TokenCreated,
    status_code=status.HTTP_201_CREATED,
    responses={
        401: {"model": ErrorResponse, "description": "wrong email or password"},
        403: {"model": ErrorResponse, "description": "the account is disabled"},
        429: {
            "model": ErrorResponse,
            "description": "too many attempts for this account or address lately (`Retry-After`)",
        },
        503: {"model": ErrorResponse, "description": "too many logins at once (`Retry-After`)"},
    },
)
async def login(data: LoginRequest, request: Request, session: SessionDep) -> TokenCreated:
    """Exchange an email and password for a new personal API token (shown once).

    Attempts are rate limited per account and per client address (429). At the per-user
    token cap, the user's oldest live token is revoked to make room.
    """
    await request.app.state.login_limiter.check(email=data.email, address=client_address(request))
    user = await service.authenticate(
        session, email=data.email, password=data.password, gate=request.app.state.hash_gate
    )
    token, plain = await run_in_threadpool(
        lambda: tokens.issue(
            session,
            user=user,
            name=data.token_name,
            expires_in_days=data.expires_in_days,
            rotate=True,
        )
    )
    return _created(token, plain, user)


@auth_router.post("/logout", status_code=status.HTTP_204_NO_CONTENT)
def logout(
    user: CurrentUser,
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> Response:
    """Revoke the API token this request was sent with."""
    if credentials is not None:
        tokens.revoke_plain(session, plain=credentials.credentials)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@users_router.get("/me", response_model=UserRead)
def me(user: CurrentUser) -> User:
    """The calling user."""
    return user


@users_router.post("/me/password", status_code=status.HTTP_204_NO_CONTENT)
async def change_password(
    data: PasswordChange,
    request: Request,
    user: CurrentUser,
    session: SessionDep,
    credential: CallerCredential,
) -> Response:
    """Change one's own password (the current one is checked). Every other session and API
    token of the account stops working; the one this request came with goes on. Attempts
    count against the account's and the address's login limits (429), and the hashes go
    through the login's bounded gate (503 when full)."""
    state = request.app.state
    await state.login_limiter.check(email=user.email, address=client_address(request))
    await service.change_password(
        session,
        user=user,
        current=data.current_password,
        new=data.new_password,
        gate=state.hash_gate,
        keep=credential,
    )
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@users_router.get("/me/tokens", response_model=list[TokenRead])
def list_tokens(user: CurrentUser, session: SessionDep, page: Page, response: Response) -> list:
    """One's own API tokens, newest first, without their secrets."""
    return paginated(list(tokens.list_for(session, user=user)), page, response)


@users_router.post("/me/tokens", response_model=TokenCreated, status_code=status.HTTP_201_CREATED)
def create_token(data: TokenCreate, user: CurrentUser, session: SessionDep) -> TokenCreated:
    """A new personal API token; its secret is in this answer only. Without
    `expires_in_days` it expires after the default (90 days); 409 at the per-user cap."""
    token, plain = tokens.issue(
        session, user=user, name=data.name, expires_in_days=data.expires_in_days
    )
    return _created(token, plain, user)


@users_router.delete("/me/tokens/{token_id}", response_model=TokenRead)
def revoke_token(token_id: int, user: CurrentUser, session: SessionDep) -> ApiToken:
    """Revoke one of one's own tokens; it stops working at once."""
    return tokens.revoke(session, user=user, token_id=token_id)


@users_router.get("", response_model=list[UserRead])
def list_users(
    admin: AdminUser,
    session: SessionDep,
    response: Response,
    offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> list:
    """Every account (admins only)."""
    response.headers["X-Total-Count"] = str(service.count(session))
    return list(service.list_all(session, offset=offset, limit=limit))


@users_router.post("", response_model=UserRead, status_code=status.HTTP_201_CREATED)
def create_user(data: UserCreate, admin: AdminUser, session: SessionDep) -> User:
    """Create an account (admins only)."""
    return service.create(session, data=data)


@users_router.get("/{user_id}", response_model=UserRead)
def get_user(user_id: int, admin: AdminUser, session: SessionDep) -> User:
    return service.get(session, user_id=user_id)


@users_router.patch("/{user_id}", response_model=UserRead)
def update_user(
    user_id: int,
    data: UserUpdate,
    admin: AdminUser,
    session: SessionDep,
    credential: CallerCredential,
) -> User:
    """Rename, change role, disable or reset the password of an account (admins only).
    A password reset ends every session and API token of the account."""
    return service.update(
        session,
        user=service.get(session, user_id=user_id),
        data=data,
        acting=admin,
        keep=credential,
    )
