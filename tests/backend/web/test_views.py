"""Display helpers of the portal's views."""

from backend.tasks.models import Task
from backend.tasks.service import rank_nodes
from backend.web.cluster_views import hardware_summary
from backend.web.views import epochs_done, spec_summary
from contracts.task_spec import TaskSpec

SPEC = {
    "epochs": 4,
    "global_batch_size": 64,
    "split_policy": "even",
    "seed": 0,
    "groups": [
        {"name": "cpu-a", "device_type": "cpu", "workers": 2},
        {"name": "gpu", "device_type": "cuda", "workers": 1},
    ],
}


def test_spec_summary_and_log_nodes() -> None:
    summary = spec_summary(TaskSpec.model_validate(SPEC))
    assert summary["groups"] == ["cpu-a × 2", "gpu × 1"]
    assert summary["workers"] == 3
    assert rank_nodes(TaskSpec.model_validate(SPEC)) == ["ps", "rank-1", "rank-2", "rank-3"]
    # The parameter server's other shards' owners come after the workers.
    sharded = TaskSpec.model_validate({**SPEC, "ps_shards": 3})
    assert rank_nodes(sharded)[-2:] == ["rank-4", "rank-5"]


def test_epochs_done_counts_whole_epochs() -> None:
    assert epochs_done(Task(spec=SPEC, progress=0.0)) == 0
    assert epochs_done(Task(spec=SPEC, progress=0.74)) == 2
    assert epochs_done(Task(spec=SPEC, progress=0.75)) == 3
    assert epochs_done(Task(spec=SPEC, progress=1.0)) == 4


def test_hardware_summary() -> None:
    hardware = {
        "cpu_cores": 8,
        "memory_bytes": 16 * 2**30,
        "cuda_devices": ["NVIDIA A100", "NVIDIA A100"],
        "torch": "2.13.0",
    }
    assert hardware_summary(hardware) == "8 cores · 16.0 GiB · 2× NVIDIA A100 · torch 2.13.0"
    assert hardware_summary({}) == "—"
