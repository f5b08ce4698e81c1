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


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(emulation.time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(emulation.time, "sleep", clock.sleep)
    return clock


def run_section(emulator: SpeedEmulator, clock: FakeClock, work: float, samples: int) -> float:
    """Emulated seconds of a section whose real work takes ``work`` seconds."""

    def section() -> None:
        clock.now += work

    return emulator.run(section, samples)[1]


def test_a_disturbance_inside_the_emulated_time_is_absorbed(clock: FakeClock) -> None:
    emulator = SpeedEmulator(0.25)
    for _ in range(4):
        assert run_section(emulator, clock, 0.1, 10) == pytest.approx(0.4)
    # another process took 0.2 s of the core: the emulated device, not this host, is unaffected
    assert run_section(emulator, clock, 0.3, 10) == pytest.approx(0.4)
    # one that took longer than the emulated time makes the section late by the excess only
    assert run_section(emulator, clock, 0.5, 10) == pytest.approx(0.5), "not multiplied by 4"
    assert run_section(emulator, clock, 0.2, 20) == pytest.approx(0.8), "twice the samples"


def test_a_lasting_slowdown_of_the_host_is_followed(clock: FakeClock) -> None:
    emulator = SpeedEmulator(0.5)
    for _ in range(emulation.WINDOW):
        run_section(emulator, clock, 0.1, 10)
    seconds = [run_section(emulator, clock, 0.15, 10) for _ in range(emulation.WINDOW)]
    assert seconds[0] == pytest.approx(0.2), "one slow section is a disturbance"
    assert seconds[-2] == pytest.approx(0.2), "so is a slow spell shorter than the window"
    assert seconds[-1] == pytest.approx(0.3), "a whole window of them is the usual speed"


def test_the_pace_comes_from_sections_of_about_the_same_size(clock: FakeClock) -> None:
    emulator = SpeedEmulator(0.5)
    for _ in range(8):  # e.g. profiling at an even share: 0.01 s per sample at 100 samples
        run_section(emulator, clock, 1.0, 100)
    # at 30 samples this host takes 0.012 s per sample; the 100-sample sections do not count
    assert run_section(emulator, clock, 0.36, 30) == pytest.approx(0.72)
    assert run_section(emulator, clock, 0.432, 36) == pytest.approx(0.864), "36 is like 30"


@pytest.mark.parametrize("factor", [0.0, -0.5, 1.5])
def test_speed_factor_out_of_range_is_refused(factor: float) -> None:
    with pytest.raises(ValueError, match="speed_factor"):
        SpeedEmulator(factor)
