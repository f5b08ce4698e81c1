from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field


class ProjectCreate(BaseModel):
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9 _.-]*$",
                      examples=["mnist"])
    description: str = Field(default="", max_length=5000)


class ProjectRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    description: str
    created_at: datetime


class CodeVersionCreate(BaseModel):
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
    created_at: datetime
