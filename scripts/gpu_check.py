"""The engine's GPU path, checked where a GPU is present: one JSON line (``make gpu-check``).

For every sync strategy (``diloco`` in both exchange modes), one task of tiny_regression on a
CUDA group of one worker beside a CPU group of one worker, ``weighted`` split, 3 epochs: every
rank must end on the same model (to 1e-5: the CUDA group's kernels round differently) and
the last validation loss must be below the first. Needs only torch and pydantic (no
database, no web stack), so it runs on a bare GPU machine. Exit 0 when every case holds,
1 when one does not, 2 without a GPU.

    python scripts/gpu_check.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.engine.local import launch_local  # noqa: E402
from worker.engine.spec import RunSpec  # noqa: E402

GROUPS = [
    {"name": "gpu", "device_type": "cuda", "workers": 1},
    {"name": "cpu", "device_type": "cpu", "workers": 1},
]
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


def check(name: str, options: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Run one case; its findings (``ok`` with the reason when not)."""
    spec = RunSpec.model_validate(
        {
            "task_id": 1,
            "code": "example:tiny_regression",
            "epochs": 3,
            "global_batch_size": 16,
            "seed": 5,
            "groups": GROUPS,
            "split_policy": "weighted",
            "checkpoint_dir": str(folder / "checkpoints"),
            "debug_dump_dir": str(folder / "dump"),
            **options,
        }
    )
    started = time.monotonic()
    run = launch_local(spec, timeout_s=300)
    found: dict[str, Any] = {"seconds": round(time.monotonic() - started, 1)}
    if not run.ok:
        return {**found, "ok": False, "why": run.text(1)[-800:] or run.text(0)[-800:]}
    finals = [torch.load(folder / "dump" / f"rank-{r}.pt") for r in range(spec.world_size)]
    spread = max(float((f - finals[0]).abs().max()) for f in finals)
    val = [v for v in run.metrics("val_loss") if v is not None]
    on_cuda = "device cuda" in run.text(1)
    ok = on_cuda and spread <= 1e-5 and len(val) == 3 and val[-1] < val[0]
    return {**found, "ok": ok, "cuda_rank": on_cuda, "max_spread": spread, "val_loss": val}


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"gpu_check": "skipped", "why": "no CUDA device"}))
        return 2
    results = {}
    with tempfile.TemporaryDirectory(prefix="polytrain-gpu-") as tmp:
        for name, options in CASES.items():
            results[name] = check(name, options, Path(tmp) / name)
    line = {
        "gpu_check": "passed" if all(r["ok"] for r in results.values()) else "failed",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cases": results,
    }
    print(json.dumps(line))
    return 0 if line["gpu_check"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
