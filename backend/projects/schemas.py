from pydantic import BaseModel, ConfigDict, Field

from backend.core.schemas import UtcDateTime
from contracts.strict import StrictModel

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 _.-]*$"


class ProjectCreate(StrictModel):
    name: str = Field(min_length=1, max_length=100, pattern=NAME_PATTERN, examples=["mnist"])
    description: str = Field(
        default="", max_length=5000, examples=["MNIST digits across two CPU groups"]
    )


class ProjectUpdate(StrictModel):
    """Changes to a project (owner or admin); omitted fields stay as they are."""

    name: str | None = Field(
        default=None, min_length=1, max_length=100, pattern=NAME_PATTERN, examples=["mnist-v2"]
    )
    description: str | None = Field(default=None, max_length=5000)


class ProjectRead(BaseModel):
    model_config = ConfigDict(
        from_attributes=True,
        json_schema_extra={
            "examples": [
                {
                    "id": 1,
                    "name": "mnist",
                    "description": "MNIST digits",
                    "owner_id": 2,
                    "created_at": "2026-11-22T06:00:00",
                    "archived_at": None,
                }
            ]
        },
    )

    id: int
    name: str
    description: str
    owner_id: int | None
    created_at: UtcDateTime
    archived_at: UtcDateTime | None = Field(
        description="set while the project is archived (read-only)"
    )


class MemberAdd(StrictModel):
    """Share a project with a user, by their email."""

    email: str = Field(min_length=3, max_length=254, examples=["grace@example.org"])


class ShareResult(BaseModel):
    """The answer to a share: the same whether or not an account has the email, so that
    sharing cannot be used to find out who has an account."""

    email: str
    message: str = Field(examples=["if an account has this email, it can now see the project"])


SHARED_MESSAGE = "if an account has this email, it can now see the project"


class MemberRead(BaseModel):
    user_id: int
    email: str
    name: str
    role: str = Field(description="`owner` or `member`", examples=["member"])


class CodeVersionCreate(StrictModel):
    """A new code version taken from a bundled example (uploads use multipart)."""

    example: str = Field(pattern=r"^[a-z0-9_]+$", examples=["mnist_cnn"])


class CodeVersionRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    project_id: int
    version: int
    source: str
    filename: str
    sha256: str
    entrypoint: str | None = Field(default=None, description="the module inside an archive")
    created_at: UtcDateTime
