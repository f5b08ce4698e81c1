"""The engine's GPU path, checked where a GPU is present: one JSON line (``make gpu-check``).

For every sync strategy (``diloco`` in its three exchange modes), one task of tiny_regression on
a CUDA group of one worker beside a CPU group of one worker, 3 epochs:

- ``weighted`` split (the speeds differ, so the split and diloco's local steps do): the CUDA
  rank really ran on CUDA, every rank ends on the same model (to 1e-5) and every validation
  loss is finite;
- ``even`` split, for the strategies whose result does not depend on which group arrives
  first (all but ``quorum`` and diloco's ``async``): the final model equals the same task run
  with both groups on CPU, to 1e-4 (the CUDA kernels round differently). That the CPU path
  learns is what the test suite checks; this check shows the CUDA path computes the same.

Then ``fsdp``: the same task with the CUDA group sharded (``sharding: fsdp``, FSDP2 over
NCCL) across two GPUs, beside the CPU group through gloo, must agree with the CPU groups'
result to 1e-4; it needs two GPUs (NCCL takes one rank per GPU) and says so where there is
one. First, the CUDA tests of the suite (tests/worker/engine/test_cuda.py) run under pytest.

Every run checks cross-device agreement (the gradient of a fixed batch before training and
the parameters every 100 steps, within the cpu/cuda tolerance of 1e-4): a run that ends
``ok`` passed those checks, which the line reports as ``agreement``.

Needs only torch, numpy, pydantic and pytest (no database, no web stack), so it runs on a bare
GPU machine (scripts/gpu_check.sh installs the last three from carried wheels).
Exit 0 when every case holds, 1 when one does not, 2 without a GPU.

    python scripts/gpu_check.py
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.engine.local import launch_local  # noqa: E402
from worker.engine.spec import RunSpec  # noqa: E402

CUDA_BESIDE_CPU = [
    {"name": "gpu", "device_type": "cuda", "workers": 1},
    {"name": "cpu", "device_type": "cpu", "workers": 1},
]
CPU_ONLY = [{**group, "device_type": "cpu"} for group in CUDA_BESIDE_CPU]
ORDER_DEPENDENT = {"quorum", "diloco_async"}
"""Cases whose result depends on which group's update reaches the parameter server first."""
CASES: dict[str, dict[str, Any]] = {
    "sync": {},
    "periodic": {"sync_strategy": "periodic", "sync_period": 4},
    "quorum": {"sync_strategy": "quorum", "quorum": 1},
    "diloco": {"sync_strategy": "diloco", "sync_period": 4},
    "diloco_overlapped": {
        "sync_strategy": "diloco",
        "sync_period": 4,
        "diloco_exchange": "overlapped",
    },
    "diloco_async": {"sync_strategy": "diloco", "sync_period": 4, "diloco_exchange": "async"},
}


def run_case(
    options: dict[str, Any], groups: list[dict[str, Any]], split: str, folder: Path
) -> tuple[float, Any, list[torch.Tensor] | None]:
    """Run one task; (seconds, the finished run, each rank's final model or None on failure)."""
    spec = RunSpec.model_validate(
        {
            "task_id": 1,
            "code": "example:tiny_regression",
            "epochs": 3,
            "global_batch_size": 16,
            "seed": 5,
            "groups": groups,
            "split_policy": split,
            # The guard would park a group of this tiny model (one group alone is faster),
            # and this check is of every group's numerics, not of the guard.
            "guard": False,
            "checkpoint_dir": str(folder / "checkpoints"),
            "debug_dump_dir": str(folder / "dump"),
            **options,
        }
    )
    started = time.monotonic()
    run = launch_local(spec, timeout_s=300)
    seconds = round(time.monotonic() - started, 1)
    if not run.ok:
        return seconds, run, None
    dump = folder / "dump"
    return seconds, run, [torch.load(dump / f"rank-{r}.pt") for r in range(spec.world_size)]


def failed(run: Any) -> str:
    """The end of the first log that says why a run failed."""
    return run.text(1)[-800:] or run.text(0)[-800:]


def check(name: str, options: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Run one case; its findings (``ok`` with the reason when not)."""
    seconds, run, finals = run_case(options, CUDA_BESIDE_CPU, "weighted", folder / "weighted")
    found: dict[str, Any] = {"seconds": seconds}
    if finals is None:
        return {**found, "ok": False, "why": failed(run)}
    spread = max(float((f - finals[0]).abs().max()) for f in finals)
    val = [v for v in run.metrics("val_loss") if v is not None]
    on_cuda = "device cuda" in run.text(1)
    ok = on_cuda and spread <= 1e-5 and len(val) == 3 and all(math.isfinite(v) for v in val)
    found |= {"cuda_rank": on_cuda, "max_spread": spread, "val_loss": val}
    if name not in ORDER_DEPENDENT:
        _, run, on_gpu = run_case(options, CUDA_BESIDE_CPU, "even", folder / "even-cuda")
        _, ref_run, on_cpu = run_case(options, CPU_ONLY, "even", folder / "even-cpu")
        if on_gpu is None or on_cpu is None:
            return {**found, "ok": False, "why": failed(run if on_gpu is None else ref_run)}
        found["max_diff_vs_cpu"] = float((on_gpu[0] - on_cpu[0]).abs().max())
        ok = ok and found["max_diff_vs_cpu"] <= 1e-4
    return {**found, "ok": ok}


SHARDED_CUDA = [
    {"name": "gpu", "device_type": "cuda", "workers": 2, "sharding": "fsdp"},
    {"name": "cpu", "device_type": "cpu", "workers": 1},
]


def check_fsdp(folder: Path) -> dict[str, Any]:
    """The CUDA group sharded over two GPUs beside the CPU group, against both on CPU."""
    if torch.cuda.device_count() < 2:
        return {"ok": True, "skipped": "needs 2 GPUs: NCCL takes one rank per GPU"}
    seconds, run, on_gpu = run_case({}, SHARDED_CUDA, "even", folder / "cuda")
    if on_gpu is None:
        return {"seconds": seconds, "ok": False, "why": failed(run)}
    cpu_groups = [{**g, "device_type": "cpu"} for g in SHARDED_CUDA]
    _, ref_run, on_cpu = run_case({}, cpu_groups, "even", folder / "cpu")
    if on_cpu is None:
        return {"seconds": seconds, "ok": False, "why": failed(ref_run)}
    diff = float((on_gpu[0] - on_cpu[0]).abs().max())
    val = [v for v in run.metrics("val_loss") if v is not None]
    ok = "device cuda" in run.text(1) and diff <= 1e-4 and all(math.isfinite(v) for v in val)
    return {"seconds": seconds, "ok": ok, "max_diff_vs_cpu": diff, "val_loss": val}


def cuda_tests() -> dict[str, Any]:
    """tests/worker/engine/test_cuda.py under pytest, without the suite's other conftest files
    (they need the web stack); passed or the end of its output."""
    repo = Path(__file__).resolve().parents[1]
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--confcutdir",
        str(repo / "tests" / "worker" / "engine"),
        str(repo / "tests" / "worker" / "engine" / "test_cuda.py"),
    ]
    done = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=1800)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    return {
        "ok": done.returncode == 0,
        "summary": last,
        **({} if done.returncode == 0 else {"why": (done.stdout + done.stderr)[-800:]}),
    }


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"gpu_check": "skipped", "why": "no CUDA device"}))
        return 2
    results = {"cuda_tests": cuda_tests()}
    with tempfile.TemporaryDirectory(prefix="polytrain-gpu-") as tmp:
        for name, options in CASES.items():
            results[name] = check(name, options, Path(tmp) / name)
        results["fsdp"] = check_fsdp(Path(tmp) / "fsdp")
    ok = all(r["ok"] for r in results.values())
    line = {
        "gpu_check": "passed" if ok else "failed",
        "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        # Every engine run checks agreement and fails on a disagreement (on_disagreement: fail).
        "agreement": "held"
        if all(r["ok"] for k, r in results.items() if k != "cuda_tests")
        else "see cases",
        "cases": results,
    }
    print(json.dumps(line))
    return 0 if line["gpu_check"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
