"""Emulated heterogeneity: make a group compute ``1 / speed_factor`` times slower.

This is *emulation* for benchmarks and tests on one machine, not a model of
any real device. After every compute section (a local forward/backward) on
``b`` samples the worker sleeps ``(1 / speed_factor - 1) * b * s``, where
``s`` is the median seconds per sample of its recent sections, so a section
takes about ``1 / speed_factor`` times its usual time. The median (rather
than the section's own time) keeps a momentary disturbance of the host, such
as another process taking the core, from being multiplied into the emulated
time: a real slower device would suffer it once, not ``1 / speed_factor``
times. A sleeping process uses no CPU, so on a machine with few cores a slow
emulated group does not steal compute from a fast one, which is what makes the
emulation faithful there. Communication is not slowed. Real heterogeneity
needs no emulation: a CUDA group beside a CPU group differs in speed by itself.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
WINDOW = 9


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on ``device`` (CUDA) so wall-clock timings are real."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeedEmulator:
    """Runs compute sections and stretches them to ``1 / speed_factor`` of their usual time.

    Raises ValueError unless ``0 < speed_factor <= 1``.
    """

    def __init__(self, speed_factor: float = 1.0, device: torch.device | None = None) -> None:
        if not 0 < speed_factor <= 1:
            raise ValueError(f"speed_factor must be in (0, 1], got {speed_factor}")
        self.speed_factor = speed_factor
        self.device = device or torch.device("cpu")
        self._per_sample: deque[float] = deque(maxlen=WINDOW)

    def run(self, section: Callable[[], T], samples: int) -> tuple[T, float]:
        """Call ``section()`` on ``samples`` samples; return its result and emulated seconds."""
        started = time.perf_counter()
        result = section()
        synchronize(self.device)
        elapsed = time.perf_counter() - started
        if self.speed_factor < 1 and samples > 0:
            self._per_sample.append(elapsed / samples)
            usual = statistics.median(self._per_sample) * samples
            time.sleep(usual * (1 / self.speed_factor - 1))
        return result, time.perf_counter() - started
