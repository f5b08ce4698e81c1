from pydantic import BaseModel, ConfigDict, Field, computed_field

from backend.core.schemas import UtcDateTime
from contracts.packages import pins
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


class PackagePin(BaseModel):
    """One package of a code version's lock."""

    name: str = Field(examples=["einops"], description="the distribution name (PEP 503)")
    version: str = Field(examples=["0.8.2"])


class CodeVersionRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    project_id: int
    version: int
    source: str
    filename: str
    sha256: str
    entrypoint: str | None = Field(default=None, description="the module inside an archive")
    requirements: str | None = Field(
        default=None,
        description="the Python packages the code declares, as declared (a requirements text, "
        "or an archive's requirements.txt / pyproject.toml dependencies)",
        examples=["einops>=0.8\n"],
    )
    lock: str | None = Field(
        default=None,
        description="what the requirements resolved to at upload: exact pins with hashes of the "
        "packages the platform lacks; none: the platform's packages only",
    )
    lock_hash: str | None = Field(
        default=None, description="sha256 of the lock: names its environment on the agents"
    )
    created_at: UtcDateTime
    uploaded_by_id: int | None = Field(
        default=None,
        description="the user who added the version (none if not recorded, or since deleted)",
    )

    @computed_field(description="the lock's packages, `name==version` each")  # type: ignore[prop-decorator]
    @property
    def packages(self) -> list[PackagePin]:
        return [
            PackagePin(name=name, version=version)
            for name, version in pins(self.lock or "").items()
        ]


class CodeFileRead(BaseModel):
    """One file of a code version: a module's one file, or each file of an archive."""

    path: str = Field(
        examples=["train.py"], description="the path inside the archive (`/`-separated)"
    )
    size_bytes: int = Field(examples=[2048])
