"""Per-task preprocessing steps as per-item transforms, applied where the items are read.

The steps a task lists (:data:`contracts.preprocess.PreprocessStep`) become the stages of a
:class:`Prepared` dataset, in the order listed: item ``i`` of the result is computed from
the user's items when it is read, in a DataLoader process on the streaming path
(:mod:`worker.engine.data`). Every stage is a pure function of the item, the seed and the
item's index, so any process reads the same item ``i`` and no worker needs another's
data. Dataset-level statistics are computed once before training, by a :class:`Fitter`,
and shipped to every worker instead of the data:

- ``tokenize`` (text; first if present): a WordPiece or BPE tokenizer trained with Hugging
  Face ``tokenizers`` on the training texts only (its vocabulary is the statistic, shipped
  as the tokenizer's JSON); an item ``(text, target)`` becomes ``(ids [L] int64, target)``,
  padded with id 0 (``[PAD]``) and truncated to ``max_length``. No download.
- ``resize`` (an image ``[C, H, W]`` or ``[H, W]``): bilinear, antialiased.
- ``normalize``: per channel ``(x - mean) / std``; means and standard deviations default
  to those of the training images as the earlier stages leave them (the statistic).
- ``augment``: offline augmentation of the training set only: the ``n`` items are followed
  by ``copies`` copies, item ``k * n + j`` being item ``j`` shifted by up to ``max_shift``
  pixels (zero padding), optionally flipped left-right, optionally with Gaussian noise,
  drawn from a generator seeded by the task's seed and the index ``k * n + j``.

Image steps act on an item's first part (its input); targets are untouched.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils.data import Dataset
from typing_extensions import override

from contracts.preprocess import Augment, Normalize, PreprocessStep, Resize, Tokenize


class PreprocessError(ValueError):
    """A preprocessing step does not fit the data (names the step)."""


def _parts(item: Any, step: str) -> tuple[Any, tuple[Any, ...]]:
    if not isinstance(item, tuple | list) or not item:
        raise PreprocessError(f"{step}: items must be (input, target, ...), got {type(item)}")
    return item[0], tuple(item[1:])


def image_of(item: Any, step: str) -> Tensor:
    """The item's input as an image ``[C, H, W]``; raises PreprocessError naming ``step``
    unless it is a float tensor ``[C, H, W]`` or ``[H, W]``."""
    image, _ = _parts(item, step)
    if not isinstance(image, Tensor) or not image.is_floating_point() or image.ndim not in (2, 3):
        shown = f"{image.dtype} {tuple(image.shape)}" if isinstance(image, Tensor) else type(image)
        raise PreprocessError(f"{step}: needs a float image [C, H, W] or [H, W], got {shown}")
    return image if image.ndim == 3 else image.unsqueeze(0)


def _with_image(item: Any, image: Tensor) -> Any:
    inputs = image if item[0].ndim == 3 else image.squeeze(0)
    return type(item)((inputs, *item[1:])) if isinstance(item, list) else (inputs, *item[1:])


class Stage(ABC):
    """One per-item transform. ``length`` maps the item count before the stage to the count
    after it; ``source`` the index after it to the index it reads before it."""

    def length(self, n: int) -> int:
        return n

    def source(self, index: int, n: int) -> int:
        return index

    @abstractmethod
    def apply(self, item: Any, index: int, n: int) -> Any:
        """Item ``index`` (of the ``length(n)`` after the stage) from ``item``, the item
        ``source(index, n)`` before it."""


@functools.lru_cache(maxsize=4)
def _tokenizer(tokenizer_json: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json)


@dataclass
class TokenizeStage(Stage):
    """``(text, target)`` to ``(ids [max_length] int64, target)`` with a trained tokenizer."""

    tokenizer_json: str

    @override
    def apply(self, item: Any, index: int, n: int) -> Any:
        text, rest = _parts(item, "tokenize")
        if not isinstance(text, str):
            raise PreprocessError(f"tokenize: items must be (text: str, target), got {type(text)}")
        ids = _tokenizer(self.tokenizer_json).encode(text).ids
        return (torch.tensor(ids, dtype=torch.int64), *rest)


@dataclass
class ResizeStage(Stage):
    size: tuple[int, int]

    @override
    def apply(self, item: Any, index: int, n: int) -> Any:
        image = image_of(item, "resize").unsqueeze(0)
        out = F.interpolate(image, size=self.size, mode="bilinear", antialias=True)
        return _with_image(item, out.squeeze(0))


@dataclass
class NormalizeStage(Stage):
    """``(x - mean) / std`` per channel; ``mean`` and ``std`` have shape ``[C]`` or ``[1]``."""

    mean: Tensor
    std: Tensor

    @override
    def apply(self, item: Any, index: int, n: int) -> Any:
        image = image_of(item, "normalize")
        channels = image.shape[0]
        if self.mean.numel() not in (1, channels) or self.std.numel() not in (1, channels):
            raise PreprocessError(f"normalize: mean/std need 1 or {channels} values")
        mean = self.mean.to(image.dtype).view(-1, 1, 1)
        std = self.std.to(image.dtype).view(-1, 1, 1)
        return _with_image(item, (image - mean) / std)


@dataclass
class AugmentStage(Stage):
    step: Augment
    seed: int

    @override
    def length(self, n: int) -> int:
        return n * (self.step.copies + 1)

    @override
    def source(self, index: int, n: int) -> int:
        return index % n

    @override
    def apply(self, item: Any, index: int, n: int) -> Any:
        if index < n:
            return item
        image = image_of(item, "augment")
        generator = torch.Generator().manual_seed((self.seed * 7919 + 17) * 1_000_003 + index)
        step = self.step
        if step.max_shift:
            _, h, w = image.shape
            dy, dx = torch.randint(0, 2 * step.max_shift + 1, (2,), generator=generator).tolist()
            padded = F.pad(image, (step.max_shift,) * 4)
            image = padded[:, dy : dy + h, dx : dx + w]
        if step.hflip and bool(torch.rand(1, generator=generator) < 0.5):
            image = image.flip(-1)
        if step.noise_std:
            image = image + step.noise_std * torch.randn(image.shape, generator=generator)
        return _with_image(item, image.clone())


class Prepared(Dataset):
    """The user's map-style ``base`` dataset seen through ``stages``: item ``i`` is computed
    when read (picklable, so DataLoader processes read it too)."""

    def __init__(self, base: Any, stages: Sequence[Stage] = ()) -> None:
        self.base = base
        self.stages = list(stages)
        self.lengths = [len(base)]
        for stage in self.stages:
            self.lengths.append(stage.length(self.lengths[-1]))

    def __len__(self) -> int:
        return self.lengths[-1]

    @override
    def __getitem__(self, index: int) -> Any:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"item {index} outside a dataset of {len(self)}")
        return self._read(len(self.stages), index)

    def _read(self, depth: int, index: int) -> Any:
        if depth == 0:
            return self.base[index]
        stage, n = self.stages[depth - 1], self.lengths[depth - 1]
        return stage.apply(self._read(depth - 1, stage.source(index, n)), index, n)


def channel_sums(items: Any) -> Tensor:
    """Per-channel ``[count, sum, sum of squares]`` of a batch of images ``[b, C, H, W]`` or
    ``[b, H, W]`` (float64, shape ``[3, C]``); counts are pixels."""
    images = items if items.ndim == 4 else items.unsqueeze(1)
    flat = images.transpose(0, 1).reshape(images.shape[1], -1).double()
    count = torch.full((flat.shape[0],), float(flat.shape[1]), dtype=torch.float64)
    return torch.stack([count, flat.sum(dim=1), (flat * flat).sum(dim=1)])


def stack_images(items: list[Any]) -> Tensor:
    """The images of ``items`` as one batch ``[b, C, H, W]`` (also a DataLoader collate_fn)."""
    return torch.stack([image_of(item, "normalize") for item in items])


def summed_channels(batches: Iterable[Tensor]) -> Tensor:
    """:func:`channel_sums` added over image ``batches`` (``[3, 0]`` when there are none)."""
    sums = torch.zeros(3, 0, dtype=torch.float64)
    for images in batches:
        part = channel_sums(images)
        sums = part if sums.numel() == 0 else sums + part
    return sums


def stats_from_sums(sums: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and (unbiased) standard deviation per channel from :func:`channel_sums` totals,
    each float32 ``[C]``; a zero deviation becomes 1e-12."""
    count, total, squares = sums[0], sums[1], sums[2]
    mean = total / count
    var = (squares - count * mean * mean) / (count - 1).clamp_min(1)
    return mean.float(), var.clamp_min(0).sqrt().clamp_min(1e-12).float()


class Fitter:
    """Computes the dataset-level statistics of a pipeline, in one process over every item.

    :class:`worker.engine.data.WorldFitter` shares the work over a task's compute workers.
    """

    def vocabulary(self, step: Tokenize, train: Any) -> str:
        """The tokenizer trained on ``train``'s texts, as JSON."""
        return train_tokenizer(step, texts_of(train, range(len(train))))

    def channel_stats(self, prefix: Prepared | None) -> tuple[Tensor, Tensor]:
        """Per-channel mean and standard deviation of every image of ``prefix``."""
        assert prefix is not None
        batches = (
            stack_images([prefix[i] for i in range(start, min(start + 256, len(prefix)))])
            for start in range(0, len(prefix), 256)
        )
        return stats_from_sums(summed_channels(batches))


def texts_of(dataset: Any, indices: Sequence[int]) -> list[str]:
    """The texts of items ``indices``; raises PreprocessError unless items are ``(str, ...)``."""
    texts = [_parts(dataset[i], "tokenize")[0] for i in indices]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise PreprocessError("tokenize: dataset items must be (text: str, target)")
    return texts


def train_tokenizer(step: Tokenize, texts: list[str]) -> str:
    """A WordPiece or BPE tokenizer trained on ``texts``, padding and truncating to
    ``step.max_length``, as JSON."""
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
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]", length=step.max_length)
    tokenizer.enable_truncation(max_length=step.max_length)
    return str(tokenizer.to_str())


def build_stages(
    steps: list[PreprocessStep], train: Any, seed: int, fitter: Fitter
) -> tuple[list[Stage], list[Stage]]:
    """The (training, validation) stages of ``steps``; statistics come from ``fitter``.

    ``train`` is the user's training dataset (None on a rank without data: the fitter
    then only takes part in computing the statistics). Validation has every stage but
    ``augment``. Raises PreprocessError when a step does not fit the data.
    """
    train_stages: list[Stage] = []
    val_stages: list[Stage] = []
    for position, step in enumerate(steps):
        stage: Stage
        if isinstance(step, Tokenize):
            if position:
                raise PreprocessError("tokenize must be the first preprocessing step")
            stage = TokenizeStage(fitter.vocabulary(step, train))
        elif isinstance(step, Resize):
            stage = ResizeStage(step.size)
        elif isinstance(step, Normalize):
            stage = _normalize_stage(step, train, train_stages, fitter)
        elif isinstance(step, Augment):
            train_stages.append(AugmentStage(step, seed))
            continue
        train_stages.append(stage)
        val_stages.append(stage)
    return train_stages, val_stages


def _normalize_stage(
    step: Normalize, train: Any, before: list[Stage], fitter: Fitter
) -> NormalizeStage:
    """The normalize stage with the given mean/std, or the fitted ones where not given."""
    if step.mean is not None and step.std is not None:
        return NormalizeStage(torch.tensor(step.mean), torch.tensor(step.std))
    mean, std = fitter.channel_stats(None if train is None else Prepared(train, before))
    return NormalizeStage(
        torch.tensor(step.mean) if step.mean is not None else mean,
        torch.tensor(step.std) if step.std is not None else std,
    )


def run_pipeline(
    steps: list[PreprocessStep], train: Any, val: Any, seed: int, fitter: Fitter | None = None
) -> tuple[Prepared, Prepared]:
    """The user's (train, validation) datasets with ``steps`` applied per item.

    Statistics come from ``fitter`` (default: this process, over every item). Raises
    PreprocessError when a step does not fit the data (at the latest when an item is read).
    """
    train_stages, val_stages = build_stages(steps, train, seed, fitter or Fitter())
    return Prepared(train, train_stages), Prepared(val, val_stages)


def bytes_of(dataset: Any) -> float:
    """Bytes a TensorDataset's tensors hold (``math.inf`` for any other dataset)."""
    tensors = getattr(dataset, "tensors", None)
    if tensors is None:
        return math.inf
    return float(sum(t.numel() * t.element_size() for t in tensors))
