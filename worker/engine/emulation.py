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

A *pace* (:class:`Pace`, ``RunSpec.emulation_pace``) fixes the undisturbed
time instead of following the host: a section on ``b`` samples is padded to
``pace.seconds(b) / speed_factor``, with ``pace`` measured once, before the
run, by :func:`calibrate_pace`, and given to every process of it. Every
emulated device then keeps one speed for the whole run, as hardware of its
own would, whatever the shared host does meanwhile (within the padding's
slack); processes started minutes apart compute at the same emulated speed,
which a pace taken from each process's own recent sections cannot give
(benchmarks compare such runs side by side).
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")
WINDOW = 32  # recent sections of a similar size whose fastest sets the pace
HISTORY = 4 * WINDOW  # recent sections kept, of any size
SIMILAR = 1.25  # sizes within this factor count as "about the same"


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on ``device`` (CUDA) so wall-clock timings are real."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Pace:
    """Undisturbed compute seconds of a section on ``b`` samples, from calibrated points.

    ``points`` are ``(samples, seconds)`` pairs, e.g. from :func:`calibrate_pace`.
    Between two points the time is interpolated linearly in ``b``; outside them
    it is proportional to ``b`` at the nearest point's seconds per sample.
    Raises ValueError for no points, a size below 1, a time not above 0 or a
    size given twice.
    """

    def __init__(self, points: Sequence[tuple[int, float]]) -> None:
        ordered = sorted((int(b), float(t)) for b, t in points)
        if not ordered:
            raise ValueError("a pace needs at least one (samples, seconds) point")
        sizes = [b for b, _ in ordered]
        if sizes[0] < 1 or min(t for _, t in ordered) <= 0 or len(set(sizes)) != len(sizes):
            raise ValueError(f"pace points need distinct sizes >= 1 and seconds > 0: {ordered}")
        self.sizes = sizes
        self.times = [t for _, t in ordered]

    def seconds(self, samples: int) -> float:
        """Seconds of a section on ``samples`` samples at this pace (0.0 for none)."""
        if samples <= 0:
            return 0.0
        i = bisect.bisect_left(self.sizes, samples)
        if i == 0 or i == len(self.sizes):
            j = min(i, len(self.sizes) - 1)
            return self.times[j] * samples / self.sizes[j]
        b0, b1, t0, t1 = self.sizes[i - 1], self.sizes[i], self.times[i - 1], self.times[i]
        return t0 + (t1 - t0) * (samples - b0) / (b1 - b0)


def calibrate_pace(
    section: Callable[[int], Any], sizes: Sequence[int], repeats: int = 15
) -> list[tuple[int, float]]:
    """Measure ``section(b)`` (a compute section on ``b`` samples) at every size in ``sizes``.

    One warm-up call per size, then ``repeats`` rounds that time every size
    once, in turn, so that a drift of the host touches all sizes alike. Returns
    ``(b, seconds)`` with the fewest seconds seen for each size: this host's
    undisturbed time, the pace of :class:`Pace`. Raises ValueError for no sizes.
    """
    if not sizes:
        raise ValueError("calibrate_pace needs at least one size")
    for b in sizes:
        section(b)
    best = dict.fromkeys(sizes, float("inf"))
    for _ in range(repeats):
        for b in sizes:
            started = time.perf_counter()
            section(b)
            best[b] = min(best[b], time.perf_counter() - started)
    return [(b, best[b]) for b in sizes]


def affine_pace(points: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The line ``seconds = a + c * samples`` through calibrated points, at the same sizes.

    A Theil-Sen fit (Theil 1950, Sen 1968): ``c`` is the median of the slopes
    between every two points and ``a`` the median of ``seconds - c * samples``,
    so one size whose timing a disturbance spoilt, which a per-size pace would
    copy into every section of that size, moves the line little. ``a`` is the
    fixed cost of a section (per-step overhead), ``c`` the cost of a sample.
    Raises ValueError for fewer than two distinct sizes or a line that is not
    positive at every size.
    """
    ordered = sorted(points)
    slopes = [
        (t1 - t0) / (b1 - b0)
        for i, (b0, t0) in enumerate(ordered)
        for b1, t1 in ordered[i + 1 :]
        if b1 != b0
    ]
    if not slopes:
        raise ValueError("an affine pace needs at least two distinct sizes")
    c = statistics.median(slopes)
    a = statistics.median(t - c * b for b, t in ordered)
    fitted = [(b, a + c * b) for b, _ in ordered]
    if min(t for _, t in fitted) <= 0:
        raise ValueError(f"the fitted pace is not positive at every size: {fitted}")
    return fitted


class SpeedEmulator:
    """Runs compute sections and pads them to ``1 / speed_factor`` times their undisturbed time.

    The undisturbed time is ``pace.seconds(b)`` when a :class:`Pace` is given,
    else this worker's fastest recent section of a similar size (module doc).
    Raises ValueError unless ``0 < speed_factor <= 1``.
    """

    def __init__(
        self,
        speed_factor: float = 1.0,
        device: torch.device | None = None,
        pace: Pace | None = None,
    ) -> None:
        if not 0 < speed_factor <= 1:
            raise ValueError(f"speed_factor must be in (0, 1], got {speed_factor}")
        self.speed_factor = speed_factor
        self.device = device or torch.device("cpu")
        self.pace = pace
        self._history: deque[tuple[int, float]] = deque(maxlen=HISTORY)

    def run(self, section: Callable[[], T], samples: int) -> tuple[T, float]:
        """Call ``section()`` on ``samples`` samples; return its result and emulated seconds."""
        started = time.perf_counter()
        result = section()
        synchronize(self.device)
        elapsed = time.perf_counter() - started
        if self.speed_factor < 1 and samples > 0:
            self._history.append((samples, elapsed / samples))
            emulated = self.undisturbed_seconds(samples) / self.speed_factor
            time.sleep(max(0.0, emulated - elapsed))
        return result, time.perf_counter() - started

    def undisturbed_seconds(self, samples: int) -> float:
        """This host's undisturbed seconds for a section on ``samples`` samples (after one ran)."""
        if self.pace is not None:
            return self.pace.seconds(samples)
        return self.usual_per_sample(samples) * samples

    def usual_per_sample(self, samples: int) -> float:
        """Fewest seconds per sample of the last ``WINDOW`` sections within ``SIMILAR`` of
        ``samples`` in size (the latest section always is one)."""
        similar = [
            per_sample
            for size, per_sample in reversed(self._history)
            if samples / SIMILAR <= size <= samples * SIMILAR
        ]
        return min(similar[:WINDOW])
