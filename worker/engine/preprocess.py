"""Per-task preprocessing steps, run once on the parameter server before sharding.

Steps run in the order the task lists them (:data:`contracts.preprocess.PreprocessStep`):

- ``tokenize`` (text; first if present): trains a WordPiece or BPE tokenizer
  with Hugging Face ``tokenizers`` on the training texts only, then encodes
  training and validation texts to token ids ``[N, max_length]`` int64,
  padded with id 0 (``[PAD]``) and truncated. No download: the vocabulary
  comes from the task's own data.
- ``resize`` (images ``[N, C, H, W]`` or ``[N, H, W]``): bilinear, antialiased.
- ``normalize``: per channel ``(x - mean) / std``; means and standard
  deviations default to those of the training images.
- ``augment``: offline augmentation of the training set only: appends
  ``copies`` copies, each image shifted by up to ``max_shift`` pixels (zero
  padding), optionally flipped left-right, optionally with Gaussian noise.
  Seeded, so a resumed task rebuilds the same data.

Image steps act on the inputs (first part of each item); targets are untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from contracts.preprocess import Augment, Normalize, PreprocessStep, Resize, Tokenize
from worker.engine.data import TensorData, stack_dataset


class PreprocessError(ValueError):
    """A preprocessing step does not fit the data (names the step)."""


def _images(data: TensorData, step: str) -> Tensor:
    inputs = data.leaves[0]
    if not inputs.is_floating_point() or inputs.ndim not in (3, 4):
        raise PreprocessError(
            f"{step}: needs float images [N, C, H, W] or [N, H, W], got "
            f"{inputs.dtype} {tuple(inputs.shape)}"
        )
    return inputs if inputs.ndim == 4 else inputs.unsqueeze(1)


def _with_inputs(data: TensorData, images: Tensor) -> TensorData:
    inputs = images if data.leaves[0].ndim == 4 else images.squeeze(1)
    return TensorData([inputs, *data.leaves[1:]], data.spec)


def resize(step: Resize, data: TensorData) -> TensorData:
    """Images resized to ``step.size`` (H, W)."""
    images = _images(data, "resize")
    out = F.interpolate(images, size=step.size, mode="bilinear", antialias=True)
    return _with_inputs(data, out)


def channel_stats(data: TensorData) -> tuple[Tensor, Tensor]:
    """Per-channel mean and standard deviation of the images, each shape ``[C]``."""
    images = _images(data, "normalize")
    return images.mean(dim=(0, 2, 3)), images.std(dim=(0, 2, 3)).clamp_min(1e-12)


def normalize(step: Normalize, data: TensorData, stats: tuple[Tensor, Tensor]) -> TensorData:
    """Images ``(x - mean) / std`` per channel; ``stats`` are the training set's defaults."""
    images = _images(data, "normalize")
    channels = images.shape[1]
    mean = torch.tensor(step.mean) if step.mean is not None else stats[0]
    std = torch.tensor(step.std) if step.std is not None else stats[1]
    if mean.numel() not in (1, channels) or std.numel() not in (1, channels):
        raise PreprocessError(f"normalize: mean/std need 1 or {channels} values")
    shape = (1, -1, 1, 1)
    out = (images - mean.to(images.dtype).view(shape)) / std.to(images.dtype).view(shape)
    return _with_inputs(data, out)


def _shifted(images: Tensor, max_shift: int, generator: torch.Generator) -> Tensor:
    n, _, h, w = images.shape
    padded = F.pad(images, (max_shift,) * 4)
    dy = torch.randint(0, 2 * max_shift + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * max_shift + 1, (n,), generator=generator)
    rows = (dy.view(n, 1) + torch.arange(h).view(1, h)).view(n, 1, h, 1)
    cols = (dx.view(n, 1) + torch.arange(w).view(1, w)).view(n, 1, 1, w)
    batch = torch.arange(n).view(n, 1, 1, 1)
    channel = torch.arange(images.shape[1]).view(1, -1, 1, 1)
    return padded[batch, channel, rows, cols]


def augment(step: Augment, data: TensorData, seed: int) -> TensorData:
    """The training set followed by ``step.copies`` augmented copies (same targets)."""
    images = _images(data, "augment")
    generator = torch.Generator().manual_seed(seed * 7919 + 17)
    copies = [images]
    for _ in range(step.copies):
        copy = _shifted(images, step.max_shift, generator) if step.max_shift else images.clone()
        if step.hflip:
            flip = torch.rand(len(copy), generator=generator) < 0.5
            copy[flip] = copy[flip].flip(-1)
        if step.noise_std:
            copy = copy + step.noise_std * torch.randn(copy.shape, generator=generator)
        copies.append(copy)
    grown = _with_inputs(data, torch.cat(copies))
    repeat = step.copies + 1
    rest = [leaf.repeat(repeat, *([1] * (leaf.ndim - 1))) for leaf in data.leaves[1:]]
    return TensorData([grown.leaves[0], *rest], data.spec)


def _texts(dataset: Any) -> tuple[list[str], list[Any]]:
    items = [dataset[i] for i in range(len(dataset))]
    if not items or not all(isinstance(item[0], str) for item in items):
        raise PreprocessError("tokenize: dataset items must be (text: str, target)")
    return [item[0] for item in items], [item[1] for item in items]


def tokenize(step: Tokenize, train: Any, val: Any) -> tuple[TensorData, TensorData]:
    """Train a tokenizer on the training texts; both sets as ``(ids [N, L] int64, targets)``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    special = ["[PAD]", "[UNK]"]
    if step.model == "bpe":
        tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
        trainer: Any = trainers.BpeTrainer(vocab_size=step.vocab_size, special_tokens=special)
    else:
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        trainer = trainers.WordPieceTrainer(vocab_size=step.vocab_size, special_tokens=special)
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    train_texts, train_targets = _texts(train)
    tokenizer.train_from_iterator(train_texts, trainer=trainer)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]", length=step.max_length)
    tokenizer.enable_truncation(max_length=step.max_length)

    def encode(texts: list[str], targets: list[Any]) -> TensorData:
        ids = torch.tensor([e.ids for e in tokenizer.encode_batch(texts)], dtype=torch.int64)
        return TensorData.from_batch((ids, torch.as_tensor(targets)))

    return encode(train_texts, train_targets), encode(*_texts(val))


def run_pipeline(
    steps: list[PreprocessStep], train: Any, val: Any, seed: int
) -> tuple[TensorData, TensorData]:
    """Apply ``steps`` to the user's (train, validation) datasets; returns both as TensorData.

    Raises PreprocessError when a step does not fit the data, ValueError when
    items do not stack into tensors.
    """
    if steps and isinstance(steps[0], Tokenize):
        train_data, val_data = tokenize(steps[0], train, val)
        steps = steps[1:]
    else:
        train_data, val_data = stack_dataset(train), stack_dataset(val)
    for step in steps:
        if isinstance(step, Resize):
            train_data, val_data = resize(step, train_data), resize(step, val_data)
        elif isinstance(step, Normalize):
            stats = channel_stats(train_data)
            train_data = normalize(step, train_data, stats)
            val_data = normalize(step, val_data, stats)
        elif isinstance(step, Augment):
            train_data = augment(step, train_data, seed)
    return train_data, val_data
