"""Emulated heterogeneity: a compute section is stretched to 1 / speed_factor of its time."""

from __future__ import annotations

import pytest

from worker.engine import emulation
from worker.engine.emulation import SpeedEmulator


class FakeClock:
    """perf_counter and sleep on a virtual clock: sleeping advances it, nothing waits."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.mark.parametrize("factor,expected_total", [(1.0, 0.2), (0.5, 0.4), (0.25, 0.8)])
def test_section_takes_one_over_speed_factor(
    monkeypatch: pytest.MonkeyPatch, factor: float, expected_total: float
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(emulation.time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(emulation.time, "sleep", clock.sleep)

    def section() -> str:
        clock.now += 0.2  # the real work takes 0.2 s
        return "result"

    result, seconds = SpeedEmulator(factor).run(section, samples=10)
    assert result == "result"
    assert seconds == pytest.approx(expected_total)
    assert sum(clock.slept) == pytest.approx(expected_total - 0.2)


def test_a_disturbed_section_is_not_multiplied(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(emulation.time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(emulation.time, "sleep", clock.sleep)
    emulator = SpeedEmulator(0.25)
    for work in (0.1, 0.1, 0.1, 0.1, 0.5):  # the last section lost 0.4 s to another process
        clock.slept.clear()

        def section(seconds: float = work) -> None:
            clock.now += seconds

        emulator.run(section, samples=10)
    assert clock.slept == [pytest.approx(0.3)], "sleep from the usual 0.1 s, not the 0.5 s"
    _, seconds = emulator.run(lambda: None, samples=20)
    assert seconds == pytest.approx(0.6), "twice the samples, twice the emulated time"


@pytest.mark.parametrize("factor", [0.0, -0.5, 1.5])
def test_speed_factor_out_of_range_is_refused(factor: float) -> None:
    with pytest.raises(ValueError, match="speed_factor"):
        SpeedEmulator(factor)
