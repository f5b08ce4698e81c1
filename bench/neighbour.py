"""A neighbour for contention measurements: a plain PyTorch training loop, not the engine.

    python -m bench.neighbour /absolute/path/to/workload.py [batch]

Loads a training-code module (``build_datasets``, ``build_model``, ``build_optimizer``,
``loss_fn``; bench/workloads/) as the engine does (``load_training_code``), prints
``ready`` once torch is imported and the model built, then trains on random batches of
``batch`` (default 256) training items until it is killed, on one torch thread.
``bench.hetero_real`` runs it in the slow group's cgroup to measure how much a busy
neighbouring core slows the fast group.
"""

from __future__ import annotations

import sys

import torch

from worker.engine.contract import load_training_code


def main(argv: list[str]) -> None:
    path, batch = argv[0], int(argv[1]) if len(argv) > 1 else 256
    code = load_training_code(path)
    torch.set_num_threads(1)
    train, _ = code.build_datasets()
    inputs, targets = train.tensors
    model = code.build_model()
    optimizer = code.build_optimizer(model.parameters())
    generator = torch.Generator().manual_seed(0)
    print("ready", flush=True)
    while True:
        idx = torch.randint(0, len(inputs), (batch,), generator=generator)
        optimizer.zero_grad()
        code.loss_fn(model(inputs[idx]), targets[idx]).backward()
        optimizer.step()


if __name__ == "__main__":
    main(sys.argv[1:])
