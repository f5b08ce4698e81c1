"""Emulated heterogeneity: a compute section is stretched to 1 / speed_factor of its time."""

from __future__ import annotations

import pytest

from worker.engine import emulation
from worker.engine.emulation import Pace, SpeedEmulator, affine_pace, calibrate_pace
from worker.engine.spec import RunSpec


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


def test_a_pace_keeps_one_speed_whatever_the_host_does(clock: FakeClock) -> None:
    pace = Pace([(10, 0.1), (20, 0.18)])
    emulator = SpeedEmulator(0.5, pace=pace)
    # a whole window of slow sections (the host at 1.5x) does not slow the emulated device
    seconds = [run_section(emulator, clock, 0.15, 10) for _ in range(emulation.WINDOW + 1)]
    assert seconds == pytest.approx([0.2] * (emulation.WINDOW + 1))
    # nor does a host faster than the calibration speed it up
    assert run_section(emulator, clock, 0.05, 10) == pytest.approx(0.2)
    # a section that cannot fit its emulated time is late by the excess only
    assert run_section(emulator, clock, 0.3, 10) == pytest.approx(0.3)
    assert run_section(emulator, clock, 0.1, 15) == pytest.approx(2 * 0.14), "interpolated"


def test_pace_interpolates_between_points_and_scales_outside() -> None:
    pace = Pace([(64, 0.012), (16, 0.004), (32, 0.0064)])
    assert pace.seconds(16) == pytest.approx(0.004)
    assert pace.seconds(48) == pytest.approx(0.0092), "halfway from 32 to 64"
    assert pace.seconds(8) == pytest.approx(0.002), "below: the smallest point's per-sample time"
    assert pace.seconds(128) == pytest.approx(0.024), "above: the largest point's"
    assert pace.seconds(0) == 0.0


@pytest.mark.parametrize("points", [[], [(0, 0.1)], [(10, 0.0)], [(10, 0.1), (10, 0.2)]], ids=str)
def test_a_pace_without_valid_points_is_refused(points: list[tuple[int, float]]) -> None:
    with pytest.raises(ValueError, match="pace"):
        Pace(points)


def test_calibration_keeps_the_fastest_time_of_each_size(clock: FakeClock) -> None:
    disturbed = iter([False, False, True, False, False, True, False, False])

    def section(samples: int) -> None:
        slow = next(disturbed, False)
        clock.now += samples * 0.001 * (3 if slow else 1)

    points = calibrate_pace(section, [10, 20], repeats=3)
    assert points == [(10, pytest.approx(0.01)), (20, pytest.approx(0.02))]


def test_a_run_spec_carries_the_pace_to_every_rank() -> None:
    fields = {
        "task_id": 1,
        "code": "example:tiny_regression",
        "epochs": 1,
        "global_batch_size": 8,
        "checkpoint_dir": "/tmp/x",
        "groups": [{"name": "a", "device_type": "cpu", "workers": 1, "speed_factor": 0.5}],
    }
    spec = RunSpec.model_validate({**fields, "emulation_pace": [[16, 0.004], [32, 0.0064]]})
    assert spec.emulation_pace == [(16, 0.004), (32, 0.0064)]
    assert RunSpec.model_validate_json(spec.model_dump_json()) == spec
    with pytest.raises(ValueError, match="emulation_pace"):
        RunSpec.model_validate({**fields, "emulation_pace": [[16, -1.0]]})


def test_an_affine_pace_is_not_moved_by_one_disturbed_size() -> None:
    # 1 ms per section plus 0.2 ms per sample, but the 256-sample timing was disturbed (+15 %)
    points = [(b, 0.001 + 0.0002 * b) for b in (16, 32, 64, 128, 192)] + [(256, 0.0525 * 1.15)]
    fitted = dict(affine_pace(points))
    assert list(fitted) == [16, 32, 64, 128, 192, 256]
    assert fitted[256] == pytest.approx(0.001 + 0.0002 * 256)
    assert fitted[16] == pytest.approx(0.0042)


@pytest.mark.parametrize(
    "points", [[(16, 0.01)], [(16, 0.01), (16, 0.02)], [(1, 1.0), (2, 0.01), (3, 0.01), (4, 0.01)]]
)
def test_an_affine_pace_needs_two_sizes_and_a_positive_line(
    points: list[tuple[int, float]],
) -> None:
    with pytest.raises(ValueError, match="pace"):
        affine_pace(points)
