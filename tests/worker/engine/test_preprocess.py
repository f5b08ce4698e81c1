"""Preprocessing steps: images (resize, normalize, augment) and text (tokenize), per item."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from contracts.preprocess import Augment, Normalize, Resize, Tokenize
from tests.worker.engine.reference import finite, run_with_dump
from worker.engine.data import TensorData, stack_dataset
from worker.engine.preprocess import PreprocessError, run_pipeline
from worker.engine.spec import RunSpec


def stacked(*args: object, **kwargs: object) -> tuple[TensorData, TensorData]:
    """:func:`run_pipeline`'s prepared datasets, every item read and stacked."""
    train, val = run_pipeline(*args, **kwargs)  # type: ignore[arg-type]
    return stack_dataset(train), stack_dataset(val)


def images(n: int = 6, channels: int = 3, size: int = 8) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(n, channels, size, size, generator=generator) * 5 + 2
    return TensorDataset(x, torch.arange(n))


def test_resize_then_normalize_with_training_statistics() -> None:
    steps = [Resize(op="resize", size=(4, 6)), Normalize(op="normalize")]
    train, val = stacked(steps, images(), images(3), seed=0)
    x = train.leaves[0]
    assert x.shape == (6, 3, 4, 6) and val.leaves[0].shape == (3, 3, 4, 6)
    torch.testing.assert_close(x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(x.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-5, rtol=0)
    assert torch.equal(train.leaves[1], torch.arange(6))


def test_normalize_with_given_values_and_grey_images() -> None:
    grey = TensorDataset(torch.full((2, 5, 5), 3.0), torch.zeros(2))
    train, _ = stacked([Normalize(op="normalize", mean=[1.0], std=[2.0])], grey, grey, 0)
    assert train.leaves[0].shape == (2, 5, 5) and torch.all(train.leaves[0] == 1.0)


def test_augment_appends_shifted_and_flipped_copies_of_the_training_set_only() -> None:
    step = Augment(op="augment", copies=2, max_shift=1, hflip=True)
    train, val = stacked([step], images(), images(3), seed=1)
    assert len(train) == 18 and len(val) == 3
    assert torch.equal(train.leaves[0][:6], images().tensors[0])
    assert torch.equal(train.leaves[1], torch.arange(6).repeat(3))
    assert not torch.equal(train.leaves[0][6:12], train.leaves[0][:6])
    again, _ = stacked([step], images(), images(3), seed=1)
    assert torch.equal(again.leaves[0], train.leaves[0]), "seeded"


def test_image_steps_refuse_non_images() -> None:
    flat = TensorDataset(torch.zeros(4, 8), torch.zeros(4))
    with pytest.raises(PreprocessError, match="resize"):
        stacked([Resize(op="resize", size=(2, 2))], flat, flat, 0)


def test_tokenize_trains_on_the_training_texts_and_pads() -> None:
    from examples.text_sentiment import build_datasets

    train_items, val_items = build_datasets()
    step = Tokenize(op="tokenize", vocab_size=200, max_length=12)
    train, val = stacked([step], train_items, val_items, seed=0)
    ids = train.leaves[0]
    assert ids.shape == (2000, 12) and ids.dtype == torch.int64 and val.leaves[0].shape[1] == 12
    assert int(ids.max()) < 200 and bool((ids[:, -1] == 0).any()), "padded with id 0"
    assert train.leaves[1].tolist() == [label for _, label in train_items]


def test_text_without_tokenize_is_refused() -> None:
    with pytest.raises(ValueError, match="tokenize"):
        stack_dataset([("a text", 1), ("another", 0)])


def test_tensor_data_takes_batches_like_collate() -> None:
    data = TensorData.from_batch((torch.arange(10).view(5, 2), {"y": torch.arange(5)}))
    inputs, target = data.take(torch.tensor([4, 0]))
    assert inputs.tolist() == [[8, 9], [0, 1]] and target["y"].tolist() == [4, 0]


COUNTING_MODULE = """
import os
from examples.text_sentiment import build_datasets as real, build_model, build_optimizer, loss_fn

def build_datasets():
    with open(os.environ["CALLS_FILE"], "a") as f:
        f.write(os.environ["RANK"] + "\\n")
    return real()
"""


def test_text_task_preprocesses_once_and_learns(
    make_spec: Callable[..., RunSpec], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, calls = tmp_path / "counting.py", tmp_path / "calls.txt"
    module.write_text(COUNTING_MODULE)
    monkeypatch.setenv("CALLS_FILE", str(calls))
    steps = [{"op": "tokenize", "vocab_size": 300, "max_length": 16}]
    spec = make_spec(
        code=str(module), preprocess=steps, global_batch_size=32, epochs=3, split_policy="weighted"
    )
    run, _ = run_with_dump(spec, tmp_path / "params")
    # Every compute worker builds its datasets itself; the parameter server never does.
    assert sorted(calls.read_text().split()) == ["1", "2", "3"]
    trained = [line for line in run.output[1] + run.output[2] if "data path" in line]
    assert len(trained) == 1 and "streaming" in trained[0], trained  # a list, not in memory
    accuracy = finite(run.metrics("val_accuracy"))
    assert accuracy[-1] > 0.9, accuracy
