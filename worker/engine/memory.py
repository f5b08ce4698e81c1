"""A rank's peak memory, as a plan's trial measures it (docs/architecture.md, "Plans").

The memory that bounds a worker is its device's on CUDA (torch's caching allocator:
``torch.cuda.max_memory_reserved``) and, on CPU, its *data memory*: heap and private writable
mappings, what the agent's ``memory_limit_mb`` caps (RLIMIT_DATA, worker/agent/processes.py).
Linux keeps no peak of data memory, only of resident memory (``VmHWM``), so the peak is taken
as the data memory now plus how far resident memory once rose above what it holds now::

    peak_data = VmData + (VmHWM - VmRSS)

``VmData`` counts what is reserved but not resident (thread stacks, untouched pages), which
stays from step to step; the rise of ``VmHWM`` over ``VmRSS`` is what a step allocated and
freed (activations, gradients, a sharded unit's gathered parameters). In this process the
free space glibc's heaps keep (``mallinfo2().fordblks``) is taken off ``VmData``: it is
mapped but free for the next allocation, and an earlier phase leaves it behind (the whole
model's moments, freed before the trial shards the model, stayed in the heaps and made a
sharded worker's peak look as large as a whole one's: 737 MiB against 755). Before the figures
are read, ``malloc_trim(0)`` hands the heaps' free pages back, so that a block a step allocated
and freed in a heap (where glibc puts blocks under its dynamic mmap threshold, up to 32 MiB)
leaves ``VmRSS`` and counts in ``VmHWM - VmRSS``; left resident in the free lists it counted
nowhere (a clean-clone run saw a whole 16M-parameter worker's peak as 611 MiB at one batch
size and 667 at another, as 32 MB gradients went to the heap or to mappings). Resetting the peak
(:func:`reset_peak`) writes ``5`` to ``/proc/self/clear_refs`` (Linux 4.0 and later), which
sets ``VmHWM`` to ``VmRSS``, after ``malloc_trim`` has handed glibc's free heap back; where
the reset is not allowed the peak is the process's whole-life peak, which is the peak of the
largest batch when the batch sizes are measured in increasing order, as the trial does.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
_FIELDS = ("VmData", "VmHWM", "VmRSS")


def status_kib(pid: int | None = None) -> dict[str, int] | None:
    """``VmData``, ``VmHWM`` and ``VmRSS`` of process ``pid`` (None: this one) in KiB; None
    where /proc has none (no such process, a zombie, no /proc)."""
    try:
        lines = (STATUS if pid is None else Path(f"/proc/{pid}/status")).read_text().splitlines()
    except OSError:
        return None
    found: dict[str, int] = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in _FIELDS:
            found[key] = int(value.split()[0])
    return found if len(found) == len(_FIELDS) else None


def reset_peak(device: torch.device) -> bool:
    """Start a new peak on ``device`` from what this process holds now. Returns whether the
    host's peak could be reset (True on CUDA, where only the device's counts)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # what an earlier phase freed is not held as reserved
        torch.cuda.reset_peak_memory_stats(device)
        return True
    trim_heaps()
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def peak_mib(device: torch.device) -> float | None:
    """The peak, in MiB, since the last :func:`reset_peak` of the memory that bounds a worker
    on ``device`` (see the module's docstring); None where it cannot be read (no /proc)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_reserved(device) / 2**20
    trim_heaps()  # freed heap pages leave RSS, so VmHWM - VmRSS counts them
    kib = status_kib()
    return None if kib is None else data_peak_mib(kib) - heap_free_bytes() / 2**20


def trim_heaps() -> None:
    """Hand glibc's free heap pages back to the kernel (``malloc_trim(0)``): they leave
    ``VmRSS`` but stay mapped. A no-op where glibc is absent."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _Mallinfo2(ctypes.Structure):
    _fields_ = [  # glibc's struct mallinfo2 (malloc.h, glibc 2.33 and later): all size_t
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def heap_free_bytes() -> int:
    """Bytes free in this process's glibc heaps (``mallinfo2().fordblks``, every arena): mapped,
    so counted in ``VmData``, but not in use. 0 where glibc or ``mallinfo2`` is absent."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return 0
    mallinfo2.restype = _Mallinfo2
    return int(mallinfo2().fordblks)


def data_peak_mib(kib: dict[str, int]) -> float:
    """The peak data memory in MiB from :func:`status_kib`'s figures:
    ``VmData + (VmHWM - VmRSS)``."""
    return (kib["VmData"] + max(0, kib["VmHWM"] - kib["VmRSS"])) / 1024
