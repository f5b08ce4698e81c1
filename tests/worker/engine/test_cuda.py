"""Real heterogeneity: a CUDA group beside a CPU group (runs only where a GPU is present)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.worker.engine.reference import dumped_batches, reference_run, run_with_dump
from worker.engine.spec import RunSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPU_AND_CPU = [
    {"name": "gpu", "device_type": "cuda", "workers": 1},
    {"name": "cpu", "device_type": "cpu", "workers": 1},
]


@pytest.mark.parametrize("strategy", ["sync", "periodic", "quorum", "diloco"])
def test_cuda_group_beside_cpu_group(
    strategy: str, make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    spec = make_spec(
        groups=GPU_AND_CPU, split_policy="weighted", sync_strategy=strategy, global_batch_size=16
    )
    run, finals = run_with_dump(spec, tmp_path / "params")
    assert "device cuda" in run.text(1)
    assert all(torch.allclose(finals[r], finals[0]) for r in (1, 2))
    if strategy == "sync":
        expected, _ = reference_run(spec, dumped_batches(tmp_path / "params"))
        torch.testing.assert_close(finals[0], expected, atol=1e-4, rtol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL takes one rank each")
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_sharded_cuda_group_beside_cpu_group(
    make_spec: Callable[..., RunSpec], tmp_path: Path, param_dtype: str
) -> None:
    groups = [
        {"name": "gpu", "device_type": "cuda", "workers": 2, "sharding": "fsdp"},
        {"name": "cpu", "device_type": "cpu", "workers": 1},
    ]
    spec = make_spec(
        groups=groups, split_policy="weighted", global_batch_size=16, fsdp_param_dtype=param_dtype
    )
    run, finals = run_with_dump(spec, tmp_path / "params")
    assert "device cuda" in run.text(1) and "device cuda" in run.text(2)
    assert all(torch.allclose(finals[r], finals[0]) for r in (1, 2, 3))
    expected, _ = reference_run(spec, dumped_batches(tmp_path / "params"))
    if param_dtype == "float32":
        torch.testing.assert_close(finals[0], expected, atol=1e-4, rtol=0)
    else:  # mixed precision: near the float32 run, within bfloat16's rounding
        assert float((finals[0] - expected).norm() / expected.norm()) < 2e-2
