"""The agent reports its hardware for its group's device type, and refuses to register a
`cuda` (or `npu`) group on a host without a usable device (issue 19, item 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from contracts.agent_api import GroupDevice, Hardware
from worker.agent import hardware, main
from worker.agent.hardware import NoDevice, detect_hardware
from worker.config import AgentSettings


def test_a_cpu_group_gets_the_cpu_model_and_host_memory() -> None:
    reported = Hardware.model_validate(detect_hardware("cpu"))
    assert reported.device_type == "cpu" and reported.device_model == hardware.cpu_model()
    assert reported.device_model.strip()
    assert reported.device_memory_mb == reported.memory_bytes // 2**20 > 0
    assert reported.cpu_cores >= 1 and reported.torch == torch.__version__


def test_a_cpu_groups_agent_does_not_import_torch(tmp_path: Path) -> None:
    """torch costs an agent 1–3 s of CPU at start and holds 200 MB; a cpu group's agent
    learns the version from the package's metadata and the host's GPUs from nvidia-smi
    (here a stand-in on PATH naming two)."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0, NVIDIA H200\\n1, NVIDIA H200\\n'\n")
    smi.chmod(0o755)
    probe = (
        "import json, sys\n"
        "from worker.agent.hardware import detect_hardware\n"
        "found = detect_hardware('cpu')\n"
        "print(json.dumps([found['torch'], found['cuda_devices'], 'torch' in sys.modules]))\n"
    )
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True
    )
    version, gpus, imported = json.loads(done.stdout)
    assert (version, gpus, imported) == (torch.__version__, ["NVIDIA H200"] * 2, False)


def test_the_gpus_listed_are_those_cuda_would_see(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0, NVIDIA A100\\n1, NVIDIA H100\\n2, NVIDIA L4\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert hardware.gpu_names() == ["NVIDIA A100", "NVIDIA H100", "NVIDIA L4"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert hardware.gpu_names() == ["NVIDIA L4", "NVIDIA A100"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert hardware.gpu_names() == []


def test_without_nvidia_smi_or_when_it_fails_there_are_no_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert hardware.gpu_names() == []
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    smi.chmod(0o755)
    assert hardware.gpu_names() == []


def test_the_cpu_model_comes_from_proc_cpuinfo() -> None:
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo on this OS")
    text = Path("/proc/cpuinfo").read_text()
    assert hardware.cpu_model() in text


def test_a_cuda_group_without_a_usable_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(NoDevice, match=r"cuda group .* no usable GPU"):
        detect_hardware("cuda")


def test_a_cuda_group_gets_the_gpu_model_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    class Properties:
        total_memory = 40 * 2**30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA A100-SXM4-40GB")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Properties())
    reported = Hardware.model_validate(detect_hardware("cuda"))
    assert (reported.device_type, reported.device_model, reported.device_memory_mb) == (
        "cuda",
        "NVIDIA A100-SXM4-40GB",
        40 * 1024,
    )
    assert reported.cuda_devices == ["NVIDIA A100-SXM4-40GB"] * 2


def test_an_npu_group_without_torch_npu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(NoDevice, match="torch_npu is not installed"):
        detect_hardware("npu")


class _GroupApi:
    """The internal API as far as registration goes: a `cuda` group, registrations recorded."""

    registered: list[dict[str, Any]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def group_device(self, resource_group: str) -> GroupDevice:
        return GroupDevice(name=resource_group, device_type="cuda")

    def register(self, **agent: Any) -> int:
        self.registered.append(agent)
        return 1


def test_the_agent_refuses_a_cuda_group_before_registering(
    settings: AgentSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(main.Sandbox, "detect", lambda **kwargs: object())
    monkeypatch.setattr(main, "InternalApi", _GroupApi)
    with pytest.raises(NoDevice, match="no usable GPU"):
        main.run_agent(settings, resource_group="gpu-a", workers=1, name="a1")
    assert _GroupApi.registered == []
    assert not (Path(settings.data_dir) / "agents").exists()  # no name claimed either
