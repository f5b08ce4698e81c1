"""The per-task preprocessing steps a user may request (`TaskCreate.preprocess`), which the
parameter server applies once to the training data (:mod:`worker.engine.preprocess`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Step(BaseModel):
    """A preprocessing step as a user writes it in a task request: unknown keys are
    refused by name (a misspelt option would otherwise be ignored)."""

    model_config = ConfigDict(extra="forbid")


class Resize(_Step):
    """Resize images ``[N, C, H, W]`` (or ``[N, H, W]``) to ``size`` = (H, W), bilinear."""

    op: Literal["resize"]
    size: tuple[int, int] = Field(description="target (height, width) in pixels")

    @model_validator(mode="after")
    def _positive(self) -> Resize:
        if min(self.size) < 1:
            raise ValueError(f"resize size must be positive, got {self.size}")
        return self


class Normalize(_Step):
    """Per-channel ``(x - mean) / std``; None computes it from the training images."""

    op: Literal["normalize"]
    mean: list[float] | None = None
    std: list[float] | None = None

    @model_validator(mode="after")
    def _positive_std(self) -> Normalize:
        if self.std is not None and min(self.std, default=1.0) <= 0:
            raise ValueError("normalize std values must be > 0")
        return self


class Augment(_Step):
    """Offline augmentation: append ``copies`` randomly shifted/flipped/noised training copies."""

    op: Literal["augment"]
    copies: int = Field(default=1, ge=1, le=10)
    max_shift: int = Field(default=2, ge=0, le=16, description="pixels")
    hflip: bool = False
    noise_std: float = Field(default=0.0, ge=0.0, le=10.0)


class Tokenize(_Step):
    """Train a WordPiece or BPE tokenizer on the training texts; inputs become ids ``[N, L]``."""

    op: Literal["tokenize"]
    model: Literal["wordpiece", "bpe"] = "wordpiece"
    vocab_size: int = Field(default=1000, ge=8, le=1_000_000)
    max_length: int = Field(default=64, ge=1, le=100_000)


PreprocessStep = Annotated[Resize | Normalize | Augment | Tokenize, Field(discriminator="op")]
