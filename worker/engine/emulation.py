"""Emulated heterogeneity: make a group compute ``1 / speed_factor`` times slower.

This is *emulation* for benchmarks and tests on one machine, not a model of
any real device. A compute section (a local forward/backward) on ``b``
samples is padded with sleep until it has lasted ``b * s / speed_factor``,
where ``s`` is the fewest seconds per sample among this worker's last
``WINDOW`` sections of about the same size (within a factor ``SIMILAR`` of
``b``, so that a batch whose per-sample cost differs, e.g. the profiling
batch, does not set the pace of another). The fastest recent section is this
host's speed undisturbed, so the emulated device computes at ``speed_factor``
times that. What disturbs the host now and then, such as another process
taking the core or the other emulated workers computing at the same moment
and sharing its caches, is absorbed inside the padding as long as one of the
last ``WINDOW`` sections ran undisturbed, as it would be on a device of its
own; only a section whose real time exceeds its emulated time is late, by the
excess alone. A lasting change of the host's speed moves the
minimum within ``WINDOW`` sections, so the emulated speed follows it. A
sleeping process uses no CPU, so on a machine with few cores a slow emulated
group does not steal compute from a fast one. Communication is not slowed.
Real heterogeneity needs no emulation: a CUDA group beside a CPU group differs
in speed by itself.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
WINDOW = 32  # recent sections of a similar size whose fastest sets the pace
HISTORY = 4 * WINDOW  # recent sections kept, of any size
SIMILAR = 1.25  # sizes within this factor count as "about the same"


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on ``device`` (CUDA) so wall-clock timings are real."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeedEmulator:
    """Runs compute sections and pads them to ``1 / speed_factor`` times their undisturbed time.

    Raises ValueError unless ``0 < speed_factor <= 1``.
    """

    def __init__(self, speed_factor: float = 1.0, device: torch.device | None = None) -> None:
        if not 0 < speed_factor <= 1:
            raise ValueError(f"speed_factor must be in (0, 1], got {speed_factor}")
        self.speed_factor = speed_factor
        self.device = device or torch.device("cpu")
        self._history: deque[tuple[int, float]] = deque(maxlen=HISTORY)

    def run(self, section: Callable[[], T], samples: int) -> tuple[T, float]:
        """Call ``section()`` on ``samples`` samples; return its result and emulated seconds."""
        started = time.perf_counter()
        result = section()
        synchronize(self.device)
        elapsed = time.perf_counter() - started
        if self.speed_factor < 1 and samples > 0:
            self._history.append((samples, elapsed / samples))
            emulated = self.usual_per_sample(samples) * samples / self.speed_factor
            time.sleep(max(0.0, emulated - elapsed))
        return result, time.perf_counter() - started

    def usual_per_sample(self, samples: int) -> float:
        """Fewest seconds per sample of the last ``WINDOW`` sections within ``SIMILAR`` of
        ``samples`` in size (the latest section always is one)."""
        similar = [
            per_sample
            for size, per_sample in reversed(self._history)
            if samples / SIMILAR <= size <= samples * SIMILAR
        ]
        return min(similar[:WINDOW])
