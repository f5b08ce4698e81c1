"""Sentiment of short review sentences: a text training-code module for polytrain.

Data: 2,400 synthetic English review sentences made from a fixed seed inside
the module ("the plot was not really boring at all", ...), labelled 1 when
positive. A negation flips the adjective's polarity, so a bag of words alone
is not enough. 2,000 are for training and 400 for validation.

Items are ``(text: str, label: int)``: the task must list a ``tokenize``
preprocessing step (e.g. ``{"op": "tokenize", "vocab_size": 500,
"max_length": 16}``), which turns each text into token ids ``[L]`` with 0 as
padding as the item is read. ``vocab_size`` must not exceed :data:`VOCAB_CAPACITY`.
Never imports polytrain.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor, nn

VOCAB_CAPACITY = 1024
DATA_SEED, N_TRAIN, N_VAL = 4242, 2000, 400
SUBJECTS = [
    "the movie",
    "this film",
    "the plot",
    "the acting",
    "the soundtrack",
    "the ending",
    "the script",
    "the cast",
    "the story",
    "the dialogue",
]
VERBS = ["was", "is", "felt", "seemed", "looked"]
POSITIVE = ["great", "wonderful", "brilliant", "moving", "delightful", "superb", "charming"]
NEGATIVE = ["awful", "boring", "dreadful", "weak", "tedious", "terrible", "clumsy"]
ADVERBS = ["", "really", "truly", "quite", "very", "rather"]
TAILS = ["", "at all", "to me", "honestly", "overall", "in the end"]


def _sentence(rng: random.Random) -> tuple[str, int]:
    positive = rng.random() < 0.5
    negated = rng.random() < 0.4
    words = [
        rng.choice(SUBJECTS),
        rng.choice(VERBS),
        "not" if negated else "",
        rng.choice(ADVERBS),
        rng.choice(POSITIVE if positive else NEGATIVE),
        rng.choice(TAILS),
    ]
    return " ".join(w for w in words if w), int(positive != negated)


def build_datasets() -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(train, validation) lists of ``(sentence, label)``, label 1 = positive."""
    rng = random.Random(DATA_SEED)
    items = [_sentence(rng) for _ in range(N_TRAIN + N_VAL)]
    return items[:N_TRAIN], items[N_TRAIN:]


class MeanEmbeddingClassifier(nn.Module):
    """Token embeddings averaged over non-padding positions, then a 2-layer MLP; 2 class scores."""

    def __init__(self, vocab: int = VOCAB_CAPACITY, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim, padding_idx=0)
        self.head = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, ids: Tensor) -> Tensor:
        """``ids`` int64 ``[N, L]`` (0 = padding) -> class scores ``[N, 2]``."""
        mask = (ids != 0).unsqueeze(-1).float()
        summed = (self.embedding(ids) * mask).sum(1)
        return self.head(summed / mask.sum(1).clamp_min(1.0))


def build_model() -> nn.Module:
    """A mean-of-embeddings classifier over at most VOCAB_CAPACITY token ids."""
    return MeanEmbeddingClassifier()


def build_optimizer(params) -> torch.optim.Optimizer:
    """Adam, learning rate 3e-3."""
    return torch.optim.Adam(params, lr=3e-3)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy of class scores [N, 2] against labels [N], mean over the batch."""
    return nn.functional.cross_entropy(output, target)
