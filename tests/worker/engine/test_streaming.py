"""The streaming data path: each worker reads only its shard, the same batches as in memory.

Real gloo processes with one DataLoader process per worker reading ahead
(``RunSpec.data``). An instrumented dataset logs every item read, by rank and
process; the in-memory path is the reference for the streaming one, with
image preprocessing whose statistics the workers fit together.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils.data import IterableDataset

from contracts.data import DataOptions
from tests.worker.engine.reference import dumped_batches, run_with_dump
from worker.engine.agreement import AGREEMENT_BATCH
from worker.engine.contract import ContractError
from worker.engine.data import check_map_style, collate, loader_workers
from worker.engine.local import launch_local
from worker.engine.spec import RunSpec
from worker.engine.split import SplitState

LOGGED_MODULE = """
import os
from torch.utils.data import Dataset
from examples.tiny_regression import build_datasets as real, build_model, build_optimizer, loss_fn

class Logged(Dataset):
    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        name = f"{os.environ['RANK']}-{os.getpid()}"
        with open(os.path.join(READS, name), "a") as log:
            log.write(f"{index}\\n")
        return self.inner[index]

def build_datasets():
    train, val = real()
    return Logged(train), val
"""


def test_each_worker_reads_exactly_its_shard_of_each_epoch(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    reads = tmp_path / "reads"
    reads.mkdir()
    module = tmp_path / "logged.py"
    module.write_text(f"READS = {str(reads)!r}\n" + LOGGED_MODULE)
    spec = make_spec(
        code=str(module),
        global_batch_size=12,
        exchange_fraction=0.25,
        data={"path": "streaming", "num_workers": 1},
        profile_budget_s=3600,  # every profile step, however slow the host (the reads counted)
    )
    run, _ = run_with_dump(spec, tmp_path / "params")
    batches = dumped_batches(tmp_path / "params")
    split = SplitState(160, 12, [4, 4, 4], [], [])  # the even split of 12 over 3 workers
    spe = split.steps_per_epoch
    for worker in range(3):
        rank = worker + 1
        files = sorted(reads.glob(f"{rank}-*"))
        # One process read everything: the worker's DataLoader process, ahead of its steps.
        assert len(files) == 1 and files[0].name != f"{rank}-{run.pids[rank]}", files
        read = [int(line) for line in files[0].read_text().split()]
        # Profiling (a two-sample warm-up, then its steps), then (the first worker) the
        # agreement check's fixed batch.
        profiled = 2 + spec.profile_steps * 4 + (AGREEMENT_BATCH if rank == 1 else 0)
        epochs = []
        for epoch in range(spec.epochs):
            mine = []
            for step in range(spe):
                counts = split.counts(step)
                start = sum(counts[:worker])
                mine += batches[epoch * spe + step][start : start + counts[worker]].tolist()
            epochs.append(mine)
        assert set(read[:profiled]) <= set(epochs[0]), "profiled outside its first shard"
        assert read[profiled:] == epochs[0] + epochs[1], f"rank {rank} read outside its steps"
    assert "neighbour exchange sent" in "\n".join(run.output[0])


IMAGES_MODULE = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

def build_datasets():
    g = torch.Generator().manual_seed(3)
    x = torch.rand(72, 3, 8, 8, generator=g) * 4 + 1
    y = torch.randint(0, 4, (72,), generator=g)
    return TensorDataset(x[:56], y[:56]), TensorDataset(x[56:], y[56:])

def build_model():
    return nn.Sequential(nn.Flatten(), nn.Dropout(0.3), nn.Linear(3 * 6 * 6, 4))

def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

def loss_fn(output, target):
    return nn.functional.cross_entropy(output, target)
"""


def test_streaming_trains_exactly_as_the_in_memory_path_with_preprocessing(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    module = tmp_path / "images.py"
    module.write_text(IMAGES_MODULE)
    steps = [
        {"op": "resize", "size": [6, 6]},
        {"op": "normalize"},
        {"op": "augment", "copies": 1, "max_shift": 1, "hflip": True},
    ]
    groups = [
        {"name": "a", "device_type": "cpu", "workers": 1},
        {"name": "b", "device_type": "cpu", "workers": 1},
    ]
    finals = {}
    for path in ("memory", "streaming"):
        spec = make_spec(
            code=str(module),
            groups=groups,
            epochs=1,
            global_batch_size=16,
            preprocess=steps,
            # A new loader iteration at every plan: it must not move the dropout's generator.
            data={"path": path, "num_workers": 1, "persistent_workers": False},
        )
        run, dumped = run_with_dump(spec, tmp_path / path)
        logged = "\n".join(run.output[0] + run.output[1])
        assert "112 training and 16 validation items" in logged  # 56 + 56 augmented
        assert f"data path: {path}" in logged
        finals[path] = dumped[0]
    assert torch.equal(finals["memory"], finals["streaming"])


DIVERGING_MODULE = """
import os
from examples.tiny_regression import build_datasets as real, build_model, build_optimizer, loss_fn

def build_datasets():
    train, val = real()
    if os.environ["RANK"] == "2":  # as a host whose copy of the data folder differs
        train = torch.utils.data.Subset(train, range(100))
    return train, val

import torch.utils.data
"""


def test_workers_whose_datasets_differ_fail_at_once_naming_the_sizes(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    module = tmp_path / "diverging.py"
    module.write_text(DIVERGING_MODULE)
    run = launch_local(make_spec(code=str(module)), timeout_s=60)
    assert not run.ok and not run.timed_out
    said = "\n".join(line for lines in run.output.values() for line in lines)
    assert "rank 1: 160 + 40, rank 2: 100 + 40, rank 3: 160 + 40" in said, said[-2000:]


class Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from range(3)


def test_bad_datasets_and_loader_settings_are_refused_naming_what_to_fix() -> None:
    with pytest.raises(ContractError, match="map-style"):
        check_map_style(Stream(), "training")
    with pytest.raises(ValueError, match="tokenize"):
        collate([("a text", 1), ("another", 0)])
    ragged = [(torch.zeros(3), 0), (torch.zeros(4), 1)]
    with pytest.raises(
        ValueError, match=r"item 0 of the batch is \(Tensor\(3,\) torch.float32, int\)"
    ):
        collate(ragged)
    cores = os.cpu_count() or 1
    with pytest.raises(ValueError, match="data.num_workers is .* this host has"):
        loader_workers(DataOptions(num_workers=cores + 1), "cpu")
    assert loader_workers(DataOptions(), "cpu") == 1
    assert loader_workers(DataOptions(), "cpu", in_memory=True) == 0  # nothing to read ahead
    assert loader_workers(DataOptions(num_workers=1), "cpu", in_memory=True) == 1
