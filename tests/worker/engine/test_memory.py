"""A rank's peak memory on CPU (worker/engine/memory.py) counts what a step allocated and freed,
wherever glibc placed it: a mapping of its own, or its heap."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from worker.engine import memory

pytestmark = pytest.mark.skipif(memory.status_kib() is None, reason="needs /proc")

# In a fresh interpreter, so that the allocator's settings are its own: glibc serves a 16 MiB
# block from its heap (mmap threshold 32 MiB, no automatic trim), as it does once its dynamic
# threshold has risen past a model's tensors. A step's activations or optimizer temporaries are
# such blocks; freed, they stay resident in the heap's free lists.
HEAP_TRANSIENT = textwrap.dedent(
    """
    import ctypes, torch
    from worker.engine import memory
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(-3, 32 << 20) == 1  # M_MMAP_THRESHOLD
    assert libc.mallopt(-1, 1 << 30) == 1  # M_TRIM_THRESHOLD
    cpu = torch.device("cpu")
    torch.ones(2**20).sum()  # torch's thread pool (its stacks) started before the baseline
    memory.reset_peak(cpu)
    base = memory.peak_mib(cpu)
    memory.reset_peak(cpu)
    block = torch.ones(4 * 2**20)  # 16 MiB, touched
    del block
    print(memory.peak_mib(cpu) - base)
    """
)


def test_a_freed_heap_block_counts_in_the_peak() -> None:
    out = subprocess.run(
        [sys.executable, "-c", HEAP_TRANSIENT], capture_output=True, text=True, check=True
    )
    rise = float(out.stdout.split()[-1])
    # the block was resident at the peak: 16 MiB, give or take what the heap kept around it
    assert 15 < rise < 18, out.stdout
