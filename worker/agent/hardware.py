"""What this host offers a resource group: its device type, model and memory, checked
before the agent registers (docs/architecture.md, "Homogeneous groups")."""

import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
from typing import Any


class NoDevice(Exception):
    """This host cannot serve the group's device type (e.g. a `cuda` group without a GPU)."""


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo, else the platform's), or `unknown`."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def host_memory_bytes() -> int:
    """The host's RAM in bytes (0 if unknown)."""
    import psutil

    return int(psutil.virtual_memory().total)


def gpu_names() -> list[str]:
    """The host's NVIDIA GPUs as `nvidia-smi` names them, without importing torch (a `cpu`
    group's host may have some: the cluster page shows them), as CUDA would see them: only
    those `CUDA_VISIBLE_DEVICES` lists by index, when it is set; none without the tool, or
    when it fails or takes over 10 s."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return []
    try:
        listed = subprocess.run(
            [tool, "--query-gpu=index,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    names: dict[str, str] = {}  # index -> name
    for line in listed.splitlines():
        index, _, name = line.partition(",")
        if name.strip():
            names[index.strip()] = name.strip()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(names.values())
    # An index list: those GPUs in that order; a UUID or anything else CUDA takes: unknown
    # here, so the devices are listed only by index.
    return [names[i.strip()] for i in visible.split(",") if i.strip() in names]


def detect_hardware(device_type: str = "cpu") -> dict[str, Any]:
    """This host's hardware as it serves a `device_type` group (`contracts.agent_api.Hardware`).

    A `cpu` group's agent does not import torch (about 1–3 s of CPU and 200 MB it would hold
    for nothing: the ranks import their own): the version comes from the installed package's
    metadata and the host's GPUs from :func:`gpu_names`.

    Raises:
        NoDevice: a `cuda` group on a host where torch sees no usable GPU, or an `npu`
            group where torch_npu is not installed or sees no NPU.
    """
    memory = host_memory_bytes()
    if device_type in ("cuda", "npu"):
        import torch

        version = str(torch.__version__)
        cuda = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if device_type == "npu":
            model, device_memory = _npu()
        elif not torch.cuda.is_available() or not cuda:
            raise NoDevice(
                "this is a cuda group but torch sees no usable GPU on this host "
                f"(torch {version}, torch.cuda.is_available() is False): install a "
                "CUDA build of torch and the NVIDIA driver, or serve a cpu group"
            )
        else:
            model, device_memory = cuda[0], torch.cuda.get_device_properties(0).total_memory
    else:
        version, cuda = importlib.metadata.version("torch"), gpu_names()
        model, device_memory = cpu_model(), memory
    return {
        "device_type": device_type,
        "device_model": model,
        "device_memory_mb": device_memory // 2**20,
        "cpu_cores": os.cpu_count() or 1,
        "memory_bytes": memory,
        "cuda_devices": cuda,
        "platform": platform.platform(),
        "torch": version,
    }


def _npu() -> tuple[str, int]:
    """The first NPU's name and memory (bytes). Raises NoDevice without a usable one."""
    if importlib.util.find_spec("torch_npu") is None:
        raise NoDevice(
            "this is an npu group but torch_npu is not installed on this host: install "
            "Ascend's torch_npu, or serve a cpu group"
        )
    import torch
    import torch_npu  # type: ignore[import-not-found]  # noqa: F401  (adds torch.npu)

    npu: Any = getattr(torch, "npu")  # noqa: B009  (only present with torch_npu)
    if not npu.is_available() or npu.device_count() == 0:
        raise NoDevice("this is an npu group but torch_npu sees no usable NPU on this host")
    return str(npu.get_device_name(0)), int(npu.get_device_properties(0).total_memory)
