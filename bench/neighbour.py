"""A neighbour for contention measurements: a plain PyTorch training loop, not the engine.

    python -m bench.neighbour /absolute/path/to/workload.py [batch]

Loads a training-code module (``build_datasets``, ``build_model``, ``build_optimizer``,
``loss_fn``; bench/workloads/) as the engine does (``load_training_code``), prints
``ready`` once torch is imported and the model built, then trains on random batches of
``batch`` (default 256) training items until it is killed, on one torch thread.
``bench.hetero_real`` and ``bench.rebalance_tracking`` run it in the slow group's cgroup
(:func:`running_beside`) to measure how much a busy neighbouring core slows the fast group.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from bench.throttle import CpuGroup

START_S = 120  # the neighbour imports torch at its quota (a third of a core)


@contextmanager
def running_beside(
    code: str, batch: int, group: CpuGroup, env: Mapping[str, str] | None = None
) -> Iterator[None]:
    """This module's training loop of the workload ``code`` (batch ``batch``, ``env`` added
    to the environment) in ``group`` (its cgroup and core) while the block runs; raises
    RuntimeError if it is not ready within START_S seconds."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.neighbour", code, str(batch)],
        env={**os.environ, **(env or {}), "POLYTRAIN_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        group.place(proc.pid)
        assert proc.stdout is not None
        # "ready" once torch is imported and the model built; nothing is printed after it.
        started, _, _ = select.select([proc.stdout], [], [], START_S)
        if not started or proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the neighbour process did not start in {START_S} s")
        yield
    finally:
        proc.kill()
        proc.wait()


def plain_training(code_path: str) -> tuple[Any, Any, Any, Any, Any]:
    """``(code, inputs, targets, model, optimizer)`` of a workload, as a plain PyTorch user
    would set it up (one torch thread; the training set's tensors whole in memory)."""
    import torch

    from worker.engine.contract import load_training_code

    torch.set_num_threads(1)
    code = load_training_code(code_path)
    torch.manual_seed(0)
    train, _ = code.build_datasets()
    inputs, targets = train.tensors
    model = code.build_model()
    return code, inputs, targets, model, code.build_optimizer(model.parameters())


def plain_step(code: Any, model: Any, optimizer: Any, inputs: Any, targets: Any, idx: Any) -> None:
    """One training step on the items ``idx``: forward, backward, ``optimizer.step``."""
    optimizer.zero_grad()
    code.loss_fn(model(inputs[idx]), targets[idx]).backward()
    optimizer.step()


def main(argv: list[str]) -> None:
    import torch

    path, batch = argv[0], int(argv[1]) if len(argv) > 1 else 256
    code, inputs, targets, model, optimizer = plain_training(path)
    generator = torch.Generator().manual_seed(0)
    print("ready", flush=True)
    while True:
        idx = torch.randint(0, len(inputs), (batch,), generator=generator)
        plain_step(code, model, optimizer, inputs, targets, idx)


if __name__ == "__main__":
    main(sys.argv[1:])
