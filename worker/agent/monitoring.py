"""Resource monitoring of the ranks this agent runs, sent with its heartbeats.

Per rank: CPU (percent of one core) and resident memory (RSS, MiB) of its process tree,
the sandbox's `bwrap` and the rank's interpreter under it (psutil); on a host with NVIDIA
GPUs also the utilization (percent) and memory (MiB) of the GPUs its processes use (NVML,
through `pynvml` when it is installed; skipped otherwise). docs/architecture.md
(Monitoring) tells what the backend does with them.
"""

import importlib
import logging
import time
from collections.abc import Hashable, Mapping
from typing import Any, TypeVar

import psutil

from contracts.agent_api import RESOURCE_SAMPLE_EVERY_S

log = logging.getLogger(__name__)
MIB = 1024 * 1024
SAMPLE_EVERY_S = RESOURCE_SAMPLE_EVERY_S
"""Seconds between two samples (at most one per heartbeat): CPU is the mean over them."""

K = TypeVar("K", bound=Hashable)


class ResourceSampler:
    """Samples process trees; keeps each process's `psutil.Process` between samples, since
    its CPU percent is measured from the previous sample (0 at its first)."""

    def __init__(self, every_s: float = SAMPLE_EVERY_S, gpus: "GpuProbe | None" = None) -> None:
        self.every_s = every_s
        self.gpus = gpus if gpus is not None else GpuProbe.detect()
        self._known: dict[int, psutil.Process] = {}
        self._last: float | None = None

    def due(self) -> bool:
        """Whether a sample is due (`every_s` since the last one); the first one is."""
        return self._last is None or time.monotonic() - self._last >= self.every_s

    def sample(self, pids: Mapping[K, int]) -> dict[K, dict[str, float | None]]:
        """`{key: {"cpu_percent", "rss_mb", "gpu_util", "gpu_mem_mb"}}` of the process tree
        rooted at each pid; a tree that is gone is left out. Processes not seen again are
        forgotten."""
        self._last = time.monotonic()
        seen: dict[int, psutil.Process] = {}
        found: dict[K, dict[str, float | None]] = {}
        for key, pid in pids.items():
            tree = self._tree(pid)
            if not tree:
                continue
            cpu = rss = 0.0
            for proc in tree:
                seen[proc.pid] = proc
                try:
                    with proc.oneshot():
                        cpu += proc.cpu_percent(interval=None)
                        rss += proc.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
            gpu_util, gpu_mem = self.gpus.usage({p.pid for p in tree})
            found[key] = {
                "cpu_percent": round(cpu, 1),
                "rss_mb": round(rss / MIB, 1),
                "gpu_util": gpu_util,
                "gpu_mem_mb": gpu_mem,
            }
        self._known = seen
        return found

    def _tree(self, pid: int) -> list[psutil.Process]:
        """The process `pid` and its descendants, as the objects kept from the last sample
        where they are the same processes."""
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return []
        kept = []
        for proc in procs:
            known = self._known.get(proc.pid)
            kept.append(known if known is not None and known == proc else proc)
        return kept


class GpuProbe:
    """The GPUs' use by given processes, read with NVML; a probe without NVML reports none.

    Untested here (no GPU on the test hosts): each NVML error leaves the values out.
    """

    def __init__(self, nvml: Any = None) -> None:
        self.nvml = nvml

    @classmethod
    def detect(cls) -> "GpuProbe":
        """A probe on NVML if `pynvml` imports and finds a GPU, else one that reports none."""
        try:
            nvml = importlib.import_module("pynvml")
            nvml.nvmlInit()
            if nvml.nvmlDeviceGetCount() > 0:
                return cls(nvml)
        except Exception:  # no pynvml, no driver, or no GPU
            pass
        return cls()

    def usage(self, pids: set[int]) -> tuple[float | None, float | None]:
        """(utilization %, memory MiB) of the GPUs that any of `pids` uses: the highest
        device utilization and the memory these processes hold; (None, None) if none."""
        if self.nvml is None:
            return None, None
        nvml, util, memory, used = self.nvml, 0.0, 0.0, False
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                device = nvml.nvmlDeviceGetHandleByIndex(index)
                mine = [
                    p for p in nvml.nvmlDeviceGetComputeRunningProcesses(device) if p.pid in pids
                ]
                if not mine:
                    continue
                used = True
                memory += sum((p.usedGpuMemory or 0) for p in mine) / MIB
                util = max(util, float(nvml.nvmlDeviceGetUtilizationRates(device).gpu))
        except Exception:
            log.debug("NVML query failed", exc_info=True)
            return None, None
        return (util, round(memory, 1)) if used else (None, None)
