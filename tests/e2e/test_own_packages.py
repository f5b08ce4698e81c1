"""A code version's own packages end to end: requirements resolved at upload, one environment
built per lock on the agents (real uv, the real index), used read-only by both groups' ranks,
and found cached by the next task. Needs the package index: marked `registry`."""

import sys
from datetime import datetime
from importlib import metadata
from pathlib import Path

import httpx
import pytest

from polytrain.stack import LocalStack
from tests.e2e.conftest import submit, wait_for

pytestmark = pytest.mark.registry

OWN_PACKAGES = b'''"""A model needing packages the platform lacks: einops, torch-optimizer."""

import einops
import torch
import torch_optimizer


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 2)

    def forward(self, x):  # (batch, 2, 4) -> (batch, 2) logits
        return self.linear(einops.rearrange(x, "b h w -> b (h w)"))


def build_model():
    return Net()


def build_datasets():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(320, 2, 4, generator=g)
    y = (x.sum(dim=(1, 2)) > 0).long()
    return list(zip(x[:256], y[:256])), list(zip(x[256:], y[256:]))


def build_optimizer(params):
    return torch_optimizer.Lamb(params, lr=0.2)


def loss_fn(output, target):
    return torch.nn.functional.cross_entropy(output, target)


def metrics(output, target):
    return {"accuracy": (output.argmax(-1) == target).float().mean().item()}
'''


def platform_state() -> tuple[dict[str, str], dict[str, float]]:
    """The platform's distributions and its site-packages entries' change times."""
    site = Path(sys.prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}")
    site /= "site-packages"
    return (
        {d.metadata["Name"]: d.version for d in metadata.distributions()},
        {p.name: p.stat().st_mtime for p in site.iterdir()},
    )


def test_code_with_its_own_packages_trains_and_the_next_task_finds_them_built(
    api: httpx.Client, stack: LocalStack, registry_cache: Path
) -> None:
    before = platform_state()
    project = api.post("/api/v1/projects", json={"name": "own-packages"}).json()
    upload = api.post(
        f"/api/v1/projects/{project['id']}/code-versions/upload",
        files={"file": ("train.py", OWN_PACKAGES, "text/x-python")},
        data={"requirements": "einops\ntorch-optimizer==0.3.0\n"},
        timeout=300,
    )
    assert upload.status_code == 201, upload.text
    version = upload.json()
    assert {p["name"] for p in version["packages"]} == {
        "einops",
        "torch-optimizer",
        "pytorch-ranger",
    }

    first = submit(api, version, epochs=3, global_batch_size=32)
    done = wait_for(api, first["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, timeout_s=300)
    assert done["status"] == "SUCCEEDED", done["status_reason"]
    metrics = api.get(f"/api/v1/tasks/{first['id']}/metrics").json()
    accuracy = [m["value"] for m in metrics if m["name"] == "val_accuracy" and m["rank"] is None]
    assert accuracy and accuracy[-1] >= 0.9, accuracy
    events = api.get(f"/api/v1/tasks/{first['id']}/events").json()
    phases = [e for e in events if e["kind"] == "phase"]
    # Each group's agent prepared (built or, for the second, waited for and found) the
    # environment; the task counts as started only once every part had it.
    timeline = [(e["kind"], e["reason"]) for e in events]  # why, if a part prepared again
    assert sum("building the code version's environment" in e["reason"] for e in phases) == 2, (
        timeline
    )
    ready = [e for e in phases if "prepared: environment" in e["reason"]]
    assert len(ready) == 2 and any(" built in " in e["reason"] for e in ready)
    [running] = [e for e in events if e["kind"] == "status" and e["to_status"] == "RUNNING"]
    started = datetime.fromisoformat(done["started_at"])
    assert started >= max(datetime.fromisoformat(e["created_at"]) for e in ready)
    assert running["created_at"] >= max(e["created_at"] for e in ready)
    logs = [line["text"] for line in api.get(f"/api/v1/tasks/{first['id']}/logs").json()]
    assert any("building 3 packages" in text for text in logs)
    assert any(text.startswith("uv: ") for text in logs)  # the installer's progress, in the log

    second = submit(api, version, epochs=1, global_batch_size=32)
    done = wait_for(api, second["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, timeout_s=300)
    assert done["status"] == "SUCCEEDED", done["status_reason"]
    logs = [line["text"] for line in api.get(f"/api/v1/tasks/{second['id']}/logs").json()]
    assert not any("building" in text for text in logs)
    assert sum(text.endswith(" cached") for text in logs) == 2  # one line per group's agent

    assert platform_state() == before  # the platform's virtualenv is untouched
