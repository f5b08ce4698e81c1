"""Request and response bodies of accounts, logins and personal API tokens."""

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from backend.auth.models import UserRole
from backend.core.schemas import UtcDateTime
from contracts.strict import StrictModel

EMAIL_PATTERN = r"^[^@\s]+@[^@\s]+$"
Email = Annotated[
    str,
    Field(min_length=3, max_length=254, pattern=EMAIL_PATTERN, examples=["ada@example.org"]),
    AfterValidator(str.lower),
]
Password = Annotated[
    str,
    Field(
        min_length=8,
        max_length=256,
        description="at least 8 characters",
        examples=["correct horse battery staple"],
    ),
]
TokenName = Annotated[str, Field(min_length=1, max_length=100, examples=["laptop CLI"])]
ExpiresInDays = Annotated[
    int | None,
    Field(
        default=None,
        ge=1,
        le=3650,
        description="days until the token expires; "
        "null: the default (POLYTRAIN_TOKEN_DEFAULT_EXPIRY_DAYS, 90)",
        examples=[90],
    ),
]


class UserCreate(StrictModel):
    """A new account (admins only)."""

    email: Email
    name: str = Field(default="", max_length=100, examples=["Ada Lovelace"])
    password: Password
    role: UserRole = UserRole.MEMBER


class UserUpdate(StrictModel):
    """Changes to an account (admins only); omitted fields stay as they are."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"role": "admin"}, {"is_active": False}]}
    )

    name: str | None = Field(default=None, max_length=100)
    role: UserRole | None = None
    is_active: bool | None = Field(
        default=None,
        description="false: the user cannot log in and every token and session stops working",
    )
    password: Password | None = None


class UserRead(BaseModel):
    model_config = ConfigDict(
        from_attributes=True,
        json_schema_extra={
            "examples": [
                {
                    "id": 2,
                    "email": "ada@example.org",
                    "name": "Ada Lovelace",
                    "role": "member",
                    "is_active": True,
                    "created_at": "2026-11-22T06:00:00",
                    "last_login_at": None,
                }
            ]
        },
    )

    id: int
    email: str
    name: str
    role: UserRole
    is_active: bool
    created_at: UtcDateTime
    last_login_at: UtcDateTime | None


class PasswordChange(StrictModel):
    """Change one's own password; the current one is asked again."""

    current_password: str = Field(max_length=256)
    new_password: Password


class LoginRequest(StrictModel):
    """Email and password, exchanged for a new personal API token (what `polytrain login` does)."""

    email: Email
    password: str = Field(min_length=1, max_length=256, examples=["correct horse battery staple"])
    token_name: TokenName = "cli"
    expires_in_days: ExpiresInDays = 90


class TokenCreate(StrictModel):
    """A new personal API token for the calling user."""

    name: TokenName
    expires_in_days: ExpiresInDays = None


class TokenRead(BaseModel):
    """A personal API token without its secret (only its first characters)."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    prefix: str = Field(description="the token's first characters, to tell tokens apart")
    created_at: UtcDateTime
    expires_at: UtcDateTime | None
    last_used_at: UtcDateTime | None
    revoked_at: UtcDateTime | None


class TokenCreated(TokenRead):
    """A token just created: `token` is shown this once and never again."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": 3,
                    "name": "laptop CLI",
                    "prefix": "pt_Vx3kQ9",
                    "token": "pt_Vx3kQ9...",
                    "created_at": "2026-11-22T06:00:00",
                    "expires_at": "2027-02-20T06:00:00",
                    "last_used_at": None,
                    "revoked_at": None,
                    "user": UserRead.model_config["json_schema_extra"]["examples"][0],  # type: ignore[index]
                }
            ]
        }
    )

    token: str = Field(description="send as `Authorization: Bearer <token>`; shown only once")
    user: UserRead
